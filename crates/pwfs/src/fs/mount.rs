//! mount: what a mount checks before it trusts an image, and the clean flag.
//!
//! The superblock's state word says whether the image was unmounted cleanly: the
//! journal empty, no orphan (an inode allocated with no name), nothing written since.
//! `mkfs` writes it clean. A writable mount clears it on the medium before its first
//! change (`CleanFlag::before_change`), and a clean unmount sets it again after its
//! final checkpoint (`CleanFlag::set_after_unmount`). A mount of an image that is not
//! known clean runs the full check (unless told never to) and the orphan scan; a mount
//! of a clean one does neither, so it costs the bitmaps, not the size of the image.
//! Metadata checksums are verified as blocks are read either way.
//!
//! Only the primary superblock's state word is written: it lies outside the checksum,
//! so the rest of the block is rewritten byte for byte and a torn write leaves either
//! state. A mount that had to use the backup superblock writes none, unless it is
//! writable and the full check passed: then it first rewrites the primary from the
//! backup (`restore_primary`).

use crate::config::{Config, MountCheck};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::format::{Superblock, BLOCK_SIZE};
use parking_lot::Mutex;

/// Whether a mount of the image `sb` describes runs the full check first.
pub(crate) fn needs_check(sb: &Superblock, config: &Config) -> bool {
    match config.check_on_mount {
        MountCheck::Always => true,
        MountCheck::IfNotClean => !sb.clean,
        MountCheck::Never => false,
    }
}

/// Whether a writable mount looks for orphans: only a clean unmount guarantees none.
pub(crate) fn needs_orphan_scan(sb: &Superblock, config: &Config) -> bool {
    !sb.clean || config.check_on_mount == MountCheck::Always
}

/// The full check, before anything is written: an image that fails it is refused
/// unchanged.
/// Superblock damage the mount repairs itself (`fsck::Report::repairable`) does not
/// count.
pub(crate) fn check(dev: &dyn Device) -> Result<()> {
    let r = crate::fsck::check(dev)?;
    let errors: Vec<&String> = r.errors.iter().filter(|e| !r.repairable.contains(e)).collect();
    if !errors.is_empty() {
        let n = errors.len();
        let first = errors.iter().take(3).map(|e| e.as_str()).collect::<Vec<_>>().join("; ");
        return Err(Error::corrupt(format!(
            "image fails its consistency check ({n} problem(s): {first}); run `pwfs fsck` for the full report"
        )));
    }
    Ok(())
}

/// Write the primary superblock with the state word saying `clean` or not, and flush.
pub(crate) fn set_clean(dev: &dyn Device, sb: &Superblock, clean: bool) -> Result<()> {
    let mut buf = dev.alloc(BLOCK_SIZE);
    Superblock { clean, ..sb.clone() }.encode(&mut buf);
    let (_, r) = dev.write(0, buf);
    r?;
    dev.flush()?;
    Ok(())
}

/// Rewrite a damaged primary superblock from the backup's contents `sb` (not clean),
/// and flush: from then on the mount keeps the state word as usual.
/// Returns whether the primary reads back whole (if not, the mount goes on from the
/// backup and writes no superblock, as without this).
pub(crate) fn restore_primary(dev: &dyn Device, sb: &Superblock) -> Result<bool> {
    set_clean(dev, sb, false)?;
    let (b, r) = dev.read(0, dev.alloc(BLOCK_SIZE));
    r?;
    let whole = Superblock::decode(&b).is_ok_and(|back| back == Superblock { clean: false, ..sb.clone() });
    if whole {
        tracing::warn!("the primary superblock was damaged: rewritten from the backup");
    } else {
        tracing::error!("the primary superblock is damaged and rewriting it from the backup did not hold");
    }
    Ok(whole)
}

/// Raise an older image to this build's format version before a writable mount
/// changes anything (version 1 images hold nothing version 2 reads differently; from
/// now on commits may carry hitchhiked deltas, which a version-1 build would not
/// replay, so it must refuse the image). Backup first, then the primary, each keeping
/// its own state word.
pub(crate) fn upgrade(dev: &dyn Device, sb: &mut Superblock) -> Result<()> {
    let from = sb.version;
    sb.version = crate::format::VERSION;
    let mut buf = dev.alloc(BLOCK_SIZE);
    Superblock { clean: false, ..sb.clone() }.encode(&mut buf);
    let (_, r) = dev.write((sb.total_blocks - 1) * crate::format::BLOCK, buf);
    r?;
    dev.flush()?;
    set_clean(dev, sb, sb.clean)?;
    tracing::info!("image upgraded from format version {from} to {}", sb.version);
    Ok(())
}

/// What the medium's state word says, for a writable mount.
pub(crate) struct CleanFlag {
    /// The state word on the medium says clean.
    on_disk: Mutex<bool>,
    /// Whether this mount may write the superblock at all (writable, primary intact).
    writes: bool,
}

impl CleanFlag {
    pub(crate) fn new(sb: &Superblock, used_backup: bool, read_only: bool) -> CleanFlag {
        CleanFlag { on_disk: Mutex::new(sb.clean && !used_backup), writes: !used_backup && !read_only }
    }

    /// Call before anything that changes metadata on the medium (journal replay, a
    /// commit): clears the state word once, durably, if it says clean.
    pub(crate) fn before_change(&self, dev: &dyn Device, sb: &Superblock) -> Result<()> {
        let mut on = self.on_disk.lock();
        if *on && self.writes {
            set_clean(dev, sb, false)?;
            *on = false;
        }
        Ok(())
    }

    /// After the final checkpoint of an unmount that left no orphan: the journal is
    /// empty and everything is durable, so the next mount may trust the image.
    pub(crate) fn set_after_unmount(&self, dev: &dyn Device, sb: &Superblock) -> Result<()> {
        let mut on = self.on_disk.lock();
        if !*on && self.writes {
            set_clean(dev, sb, true)?;
            *on = true;
        }
        Ok(())
    }
}
