//! mkfs: lay out and format a device; read and check its superblock.

use super::meta;
use crate::device::{AlignedBuf, Device, Op, OpKind};
use crate::error::{Error, Result};
use crate::format::{self as f, Superblock, BLOCK, BLOCK_SIZE};
use crate::journal;

/// Options for formatting a device.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Number of inodes (default: one per 16 KiB, at least 1024).
    pub inodes: Option<u64>,
    /// Journal size in blocks (default: 1/64 of the device, 256..=16384 blocks).
    pub journal_blocks: Option<u64>,
}

fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Format `dev`. Everything on it is lost.
pub fn mkfs(dev: &dyn Device, opts: &MkfsOptions) -> Result<Superblock> {
    mkfs_with_progress(dev, opts, &mut |_, _| {})
}

/// Block-bitmap blocks written per request.
const BITMAP_BATCH: u64 = 64;

/// Set bits `from..to` of a bitmap block's bytes.
fn set_bits(b: &mut [u8], from: u64, to: u64) {
    let mut i = from;
    while i < to {
        if i.is_multiple_of(8) && to - i >= 8 {
            let n = ((to - i) / 8) as usize;
            b[(i / 8) as usize..(i / 8) as usize + n].fill(0xff);
            i += n as u64 * 8;
        } else {
            b[(i / 8) as usize] |= 1 << (i % 8);
            i += 1;
        }
    }
}

/// Format `dev`, calling `progress(done, total)` as it goes (in blocks written). What
/// it writes does not depend on the size of the device beyond its bitmaps: the inode
/// table is not zeroed (the inode bitmap is authoritative: a table slot is read only
/// while its bit is set, and the first inode to land in a table block zeroes the rest
/// of it), so an earlier format's table is never taken for inodes.
pub fn mkfs_with_progress(
    dev: &dyn Device,
    opts: &MkfsOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Superblock> {
    let total = dev.len() / BLOCK;
    if total < 64 {
        return Err(Error::invalid(format!("device too small: {} bytes (need at least 256 KiB)", dev.len())));
    }
    let inodes = opts.inodes.unwrap_or((total / 4).max(1024)).min(u32::MAX as u64);
    // The log must hold the largest single operation: a truncate or delete that
    // changes every block-bitmap block, plus a few inode and directory blocks.
    let min_journal = total.div_ceil(f::BITS_PER_BITMAP_BLOCK) + 32;
    let jblocks = match opts.journal_blocks {
        Some(n) if n < min_journal => {
            return Err(Error::invalid(format!(
                "a journal of {n} blocks is too small for {total} blocks: it needs at least {min_journal}"
            )))
        }
        Some(n) => n.min(total / 4).min(f::max_journal_blocks(total)).max(16),
        None => (total / 64).clamp(256, 16384).max(min_journal).min(total / 4).max(16),
    };
    let mut uuid = [0u8; 16];
    rand::Rng::fill(&mut rand::thread_rng(), &mut uuid[..]);
    let mut sb = Superblock::layout(total, inodes, jblocks, uuid, now_ns())
        .map_err(|e| Error::invalid(format!("cannot lay out a file system on {total} blocks: {e}")))?;
    let write = |block: u64, bufs: Vec<AlignedBuf>| -> Result<()> {
        for d in dev.submit(vec![Op { kind: OpKind::Write, offset: block * BLOCK, bufs }]) {
            d.result?;
        }
        Ok(())
    };
    // Bitmaps, the root's table block, the journal's header and first log block, the
    // two superblocks.
    let work = sb.block_bitmap_blocks + sb.inode_bitmap_blocks + 5;
    let mut done = 0;
    progress(done, work);
    // The first log block: zeroed, so that no log block of an earlier format is read
    // as the start of a transaction (a fresh start sequence below does the rest).
    write(sb.journal_start + 1, vec![dev.alloc_zeroed(BLOCK_SIZE)])?;
    done += 1;
    // Both bitmaps, in batches of BITMAP_BATCH blocks: a request of more than 1,024
    // buffers is refused by the kernel (IOV_MAX), and past ~33.5 M inodes the inode
    // bitmap alone has more blocks than that. `fill` sets the bits of bitmap block i.
    let mut bitmap = |start: u64, blocks: u64, fill: &dyn Fn(u64, &mut [u8])| -> Result<()> {
        let mut i = 0;
        while i < blocks {
            let n = (blocks - i).min(BITMAP_BATCH);
            let bufs = (i..i + n)
                .map(|i| {
                    let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
                    fill(i, &mut buf);
                    f::bitmap_seal(&mut buf, i);
                    buf
                })
                .collect();
            write(start + i, bufs)?;
            i += n;
            done += n;
            progress(done, work);
        }
        Ok(())
    };
    // Block bitmap: everything outside the data area is in use.
    bitmap(sb.block_bitmap_start, sb.block_bitmap_blocks, &|i, buf| {
        let first = i * f::BITS_PER_BITMAP_BLOCK;
        let bits = f::BITS_PER_BITMAP_BLOCK;
        let local = |blk: u64| blk.clamp(first, first + bits) - first;
        set_bits(buf, local(0), local(sb.data_start));
        set_bits(buf, local(sb.data_end), local(total));
    })?;
    // Inode bitmap: the root inode.
    bitmap(sb.inode_bitmap_start, sb.inode_bitmap_blocks, &|i, buf| {
        if i == 0 {
            buf[0] = 1;
        }
    })?;
    let t = meta::now();
    let root = f::DiskInode {
        mode: f::S_IFDIR | 0o755,
        nlink: 2,
        parent: f::ROOT_INO,
        atime: t,
        mtime: t,
        ctime: t,
        generation: 1,
        ..Default::default()
    };
    // The root's table block whole: its other slots are free, and zero.
    let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
    root.encode(f::ROOT_INO, &mut buf[..f::INODE_SIZE]);
    write(sb.inode_table_start, vec![buf])?;
    // A start sequence nobody used before on this medium, so stale log blocks never match.
    let start_seq = (rand::random::<u32>() as u64) << 20 | 1;
    journal::write_header(dev, sb.journal_start, start_seq)?;
    done += 2;
    progress(done, work);
    // The backup never says clean (only the primary's state word is kept up to date),
    // so that a mount that has to fall back on it checks the image.
    let mut buf = dev.alloc(BLOCK_SIZE);
    sb.encode(&mut buf);
    write(total - 1, vec![buf])?;
    dev.flush()?;
    // The primary superblock last: until it is written the device is not a pwfs image.
    sb.clean = true;
    let mut buf = dev.alloc(BLOCK_SIZE);
    sb.encode(&mut buf);
    write(0, vec![buf])?;
    dev.flush()?;
    progress(work, work);
    Ok(sb)
}

/// Read and check the superblock, falling back to the backup copy.
pub fn read_superblock(dev: &dyn Device) -> Result<(Superblock, bool)> {
    let total = dev.len() / BLOCK;
    if total < 64 {
        return Err(Error::corrupt(format!("not a pwfs image: too small to hold one ({} bytes)", dev.len())));
    }
    let read = |b: u64| -> Result<AlignedBuf> {
        let (buf, r) = dev.read(b * BLOCK, dev.alloc(BLOCK_SIZE));
        r?;
        Ok(buf)
    };
    let (sb, backup) = match Superblock::decode(&read(0)?) {
        Ok(sb) => (sb, false),
        Err(primary) => match Superblock::decode(&read(total - 1)?) {
            // The backup's state word is never kept up to date: not known clean.
            Ok(sb) if !matches!(primary, f::FormatError::Magic { .. }) => (Superblock { clean: false, ..sb }, true),
            _ => {
                return Err(Error::corrupt(match primary {
                    f::FormatError::Magic { .. } => "not a pwfs image (no superblock magic)".to_string(),
                    e => format!("bad superblock and no usable backup: {e}"),
                }))
            }
        },
    };
    if sb.total_blocks > total {
        return Err(Error::corrupt(format!(
            "image truncated: superblock says {} blocks, device has {total}",
            sb.total_blocks
        )));
    }
    Ok((sb, backup))
}
