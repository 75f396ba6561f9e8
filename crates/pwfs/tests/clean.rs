//! The clean flag and what a mount checks: mkfs leaves the inode table as it finds it
//! (an earlier image's inodes are never taken for this one's), a mount clears the flag
//! and a clean unmount sets it, a mount of an image not known clean runs the full check
//! and refuses a damaged one, and a clean image's metadata is still checksummed as it
//! is read.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::device::sim::{SimConfig, SimDevice};
use pwfs::device::Device;
use pwfs::format::{self as f, BLOCK};
use pwfs::{Config, ErrorKind, Fs, MkfsOptions, MountCheck};
use std::sync::Arc;

fn read_only() -> Config {
    Config { read_only: true, ..test_config() }
}

fn mem(img: &[u8]) -> Arc<MemDevice> {
    Arc::new(MemDevice::from_vec(img.to_vec()))
}

fn clean(dev: &dyn Device) -> bool {
    pwfs::fs::read_superblock(dev).unwrap().0.clean
}

fn populate(fs: &Fs, dirs: usize, files: usize) {
    for d in 0..dirs {
        fs.create_dir(format!("/d{d}"), 0o755).unwrap();
        for i in 0..files {
            fs.write_file(format!("/d{d}/f{i}"), &vec![(d * files + i) as u8; 100 + i * 37]).unwrap();
        }
    }
    fs.symlink_path("d0/f1", "/s").unwrap();
}

/// A populated image, unmounted cleanly.
fn populated_image(size: u64, opts: &MkfsOptions) -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(size));
    pwfs::mkfs(&*dev, opts).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    populate(&fs, 4, 40);
    fs.unmount().unwrap();
    dev.snapshot()
}

#[test]
fn mkfs_over_an_old_image_is_empty_and_consistent() {
    let old = populated_image(16 * MIB, &MkfsOptions { inodes: Some(256), journal_blocks: Some(64) });
    for opts in [
        // The same layout: the old table is where the new one is, full of old inodes.
        MkfsOptions { inodes: Some(256), journal_blocks: Some(64) },
        // Another inode count and journal: old tables, bitmaps and directories under
        // the new table.
        MkfsOptions { inodes: Some(1024), journal_blocks: Some(80) },
    ] {
        let dev = Arc::new(MemDevice::from_vec(old.clone()));
        let sb = pwfs::mkfs(&*dev, &opts).unwrap();
        assert!(clean(&*dev), "mkfs leaves the image clean");
        // The table was not zeroed: some block of it past the root's still holds bytes.
        let img = dev.snapshot();
        let table = &img[((sb.inode_table_start + 1) * BLOCK) as usize..(sb.data_start * BLOCK) as usize];
        assert!(table.iter().any(|b| *b != 0), "{opts:?}: the test needs garbage in the table");
        fsck_clean(&*dev);
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        assert!(fs.read_dir("/").unwrap().is_empty(), "{opts:?}: the root is empty");
        assert_eq!(fs.statfs().inodes - fs.statfs().inodes_free, 1, "{opts:?}: only the root is in use");
        // New inodes land in table blocks that hold old bytes.
        populate(&fs, 3, 50);
        fs.unmount().unwrap();
        fsck_clean(&*dev);
        let fs = Fs::mount(dev.clone(), Config { check_on_mount: MountCheck::Always, ..test_config() }).unwrap();
        assert_eq!(fs.read_dir("/").unwrap().len(), 4, "{opts:?}");
        assert_eq!(fs.read_file("/d2/f49").unwrap(), vec![(2 * 50 + 49) as u8; 100 + 49 * 37]);
        fs.unmount().unwrap();
    }
}

#[test]
fn the_flag_is_cleared_while_mounted_and_set_by_a_clean_unmount() {
    let dev = Arc::new(MemDevice::new(16 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    assert!(clean(&*dev));
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert!(fs.read_dir("/").unwrap().is_empty());
    fs.sync().unwrap();
    assert!(clean(&*dev), "nothing changed yet: still clean");
    fs.write_file("/a", b"hello").unwrap();
    fs.sync().unwrap();
    assert!(!clean(&*dev), "cleared before the first change reached the medium");
    fs.write_file("/b", b"more").unwrap();
    fs.sync().unwrap();
    assert!(!clean(&*dev));
    fs.unmount().unwrap();
    assert!(clean(&*dev), "a clean unmount sets it");
    fsck_clean(&*dev);

    // A read-only mount writes nothing, the flag included.
    let before = dev.snapshot();
    let fs = Fs::mount(dev.clone(), read_only()).unwrap();
    assert_eq!(fs.read_file("/a").unwrap(), b"hello");
    drop(fs);
    assert!(dev.snapshot() == before, "a read-only mount changed the image");

    // An unmount that leaves an orphan (a file unlinked while open) does not set it:
    // only the orphan scan of the next mount would free that inode.
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let f = pwfs::OpenOptions::new().write(true).create(true).open(&fs, "/open").unwrap();
    f.write_at(b"data", 0).unwrap();
    fs.remove_file("/open").unwrap();
    fs.clone().unmount().unwrap();
    assert!(!clean(&*dev), "unmounted with an orphan: not clean");
    drop(f);
    drop(fs);
    assert!(clean(&*dev), "the last handle gone, the orphan freed: clean");
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert!(r.is_clean() && r.notes.is_empty() && r.marked_clean, "{:?} {:?}", r.errors, r.notes);
}

#[test]
fn a_mount_of_an_image_not_known_clean_checks_it() {
    let good = populated_image(16 * MIB, &MkfsOptions { inodes: Some(512), journal_blocks: Some(64) });
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    assert!(sb.clean);
    // Damage no checksum sees: a data block in use marked free in the block bitmap.
    let fs = Fs::mount(mem(&good), read_only()).unwrap();
    let ino = fs.metadata("/d1/f7").unwrap().ino;
    drop(fs);
    let tblk = sb.inode_table_start + (ino - 1) / f::INODES_PER_BLOCK;
    let off = (tblk * BLOCK) as usize + ((ino - 1) % f::INODES_PER_BLOCK) as usize * f::INODE_SIZE;
    let data_blk = f::DiskInode::decode(ino, &good[off..off + f::INODE_SIZE]).unwrap().unwrap().extents[0].physical;
    let mut bad = good.clone();
    let bm = sb.block_bitmap_start + data_blk / f::BITS_PER_BITMAP_BLOCK;
    let bit = data_blk % f::BITS_PER_BITMAP_BLOCK;
    let r = (bm * BLOCK) as usize..((bm + 1) * BLOCK) as usize;
    bad[r.clone()][(bit / 8) as usize] &= !(1 << (bit % 8));
    f::bitmap_seal(&mut bad[r], bm - sb.block_bitmap_start);
    let not_clean = |img: &[u8]| {
        let mut img = img.to_vec();
        img[f::SB_STATE_AT..f::SB_STATE_AT + 8].fill(0);
        img
    };

    // Marked clean: trusted (only a check asked for finds it).
    let dev = Arc::new(SimDevice::new(bad.clone(), SimConfig::default()));
    let e = Fs::mount(dev.clone(), Config { check_on_mount: MountCheck::Always, ..test_config() }).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(dev.snapshot() == bad, "a refused mount changed the image");
    drop(Fs::mount(dev.clone(), read_only()).unwrap());

    // Not clean (zero state word, as an image from before the flag has, or one that
    // was not unmounted): checked, and refused unchanged.
    for cfg in [test_config(), read_only()] {
        let img = not_clean(&bad);
        let dev = Arc::new(SimDevice::new(img.clone(), SimConfig::default()));
        let e = Fs::mount(dev.clone(), cfg).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("consistency check"), "{e}");
        assert!(dev.snapshot() == img, "a refused mount changed the image");
    }
    // ... unless told never to check.
    let never = Config { check_on_mount: MountCheck::Never, ..read_only() };
    drop(Fs::mount(mem(&not_clean(&bad)), never).unwrap());
    // An intact image that is not known clean passes its check, and a clean unmount
    // marks it clean again.
    let dev = Arc::new(MemDevice::from_vec(not_clean(&good)));
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/d1/f7").unwrap().len(), 100 + 7 * 37);
    fs.unmount().unwrap();
    assert!(clean(&*dev));

    // The image of a live mount that has changed something (what a crash leaves) is
    // not clean: checked.
    let dev = Arc::new(MemDevice::from_vec(good.clone()));
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    fs.set_permissions("/d0", 0o700).unwrap();
    fs.sync().unwrap();
    let mut crashed = dev.snapshot();
    drop(fs);
    assert!(!pwfs::fs::read_superblock(&MemDevice::from_vec(crashed.clone())).unwrap().0.clean);
    crashed[(bm * BLOCK) as usize + (bit / 8) as usize] &= !(1 << (bit % 8));
    let r = (bm * BLOCK) as usize..((bm + 1) * BLOCK) as usize;
    f::bitmap_seal(&mut crashed[r], bm - sb.block_bitmap_start);
    let dev = Arc::new(SimDevice::new(crashed.clone(), SimConfig::default()));
    assert_eq!(Fs::mount(dev.clone(), test_config()).unwrap_err().kind(), ErrorKind::Corrupt);
    assert!(dev.snapshot() == crashed);
}

#[test]
fn a_clean_image_is_still_checksummed_as_it_is_read() {
    let good = populated_image(16 * MIB, &MkfsOptions { inodes: Some(512), journal_blocks: Some(64) });
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    let fs = Fs::mount(mem(&good), read_only()).unwrap();
    let ino = fs.metadata("/d2/f3").unwrap().ino;
    let dir = fs.metadata("/d3").unwrap().ino;
    drop(fs);
    let slot = |ino: u64| {
        let tblk = sb.inode_table_start + (ino - 1) / f::INODES_PER_BLOCK;
        (tblk * BLOCK) as usize + ((ino - 1) % f::INODES_PER_BLOCK) as usize * f::INODE_SIZE
    };
    // A bit flipped in a file's inode, and in a directory's first block.
    let mut img = good.clone();
    img[slot(ino) + 20] ^= 0x08;
    let d = f::DiskInode::decode(dir, &good[slot(dir)..slot(dir) + f::INODE_SIZE]).unwrap().unwrap();
    img[(d.extents[0].physical * BLOCK) as usize + 40] ^= 0x01;
    let dev = Arc::new(MemDevice::from_vec(img));
    let fs = Fs::mount(dev.clone(), test_config()).expect("a clean image mounts without the full check");
    let e = fs.read_file("/d2/f3").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(fs.read_dir("/d3").is_err(), "a damaged directory block is refused");
    assert_eq!(fs.read_file("/d2/f4").unwrap().len(), 100 + 4 * 37, "the rest reads");
    drop(fs);
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert!(r.errors.iter().any(|e| e.contains(&format!("inode {ino}")) && e.contains("checksum")), "{:?}", r.errors);
    assert!(r.errors.iter().any(|e| e.contains(&format!("directory {dir}"))), "{:?}", r.errors);
}

#[test]
fn mkfs_and_fsck_report_progress() {
    let dev = MemDevice::new(64 * MIB);
    let mut seen = Vec::new();
    pwfs::fs::mkfs_with_progress(&dev, &MkfsOptions::default(), &mut |d, t| seen.push((d, t))).unwrap();
    let last = *seen.last().unwrap();
    assert!(last.0 == last.1 && last.1 > 0, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
    let dev = MemDevice::from_vec(populated_image(16 * MIB, &MkfsOptions::default()));
    let mut seen = Vec::new();
    let r = pwfs::fsck::check_with_progress(&dev, &mut |d, t| seen.push((d, t))).unwrap();
    assert!(r.is_clean() && r.marked_clean);
    let last = *seen.last().unwrap();
    assert!(last.0 == last.1 && last.1 > 4, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1 && w[1].0 <= w[1].1), "{seen:?}");
}

/// A mount that fails after it began (here: a root directory with one link, which a
/// mount that skips the check meets only then) writes nothing more than its recovery
/// did: the image stays as it was, not clean. Before, dropping the half-made file system committed, checkpointed
/// and marked the image clean, and the next mount skipped the check that would have
/// refused it.
#[test]
fn a_failed_mount_leaves_the_image_as_it_was() {
    let dev = Arc::new(MemDevice::new(32 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    fs.write_file("/f", b"data").unwrap();
    fs.unmount().unwrap();
    // Not clean (as a crash after a mount's first change leaves it; the journal is
    // empty, so no replay puts the root back): the superblock's state word only.
    let sb = pwfs::fs::read_superblock(&*dev).unwrap().0;
    let (mut as_clean, mut not_clean) = (vec![0u8; BLOCK as usize], vec![0u8; BLOCK as usize]);
    f::Superblock { clean: true, ..sb.clone() }.encode(&mut as_clean);
    f::Superblock { clean: false, ..sb.clone() }.encode(&mut not_clean);
    let (first, _) = dev.read(0, dev.alloc(BLOCK as usize));
    let mut first = first.to_vec();
    for i in 0..first.len() {
        if as_clean[i] != not_clean[i] {
            first[i] = not_clean[i];
        }
    }
    let mut buf = dev.alloc(BLOCK as usize);
    buf.copy_from_slice(&first);
    dev.write(0, buf).1.unwrap();
    assert!(!clean(&*dev));
    // The root's link count set to 1, its checksum right.
    let (block, _) = dev.read(sb.inode_table_start * BLOCK, dev.alloc(BLOCK as usize));
    let mut block = block.to_vec();
    let mut root = f::DiskInode::decode(f::ROOT_INO, &block[..f::INODE_SIZE]).unwrap().expect("the root inode");
    root.nlink = 1;
    root.encode(f::ROOT_INO, &mut block[..f::INODE_SIZE]);
    let mut buf = dev.alloc(BLOCK as usize);
    buf.copy_from_slice(&block);
    dev.write(sb.inode_table_start * BLOCK, buf).1.unwrap();
    let before = dev.snapshot();
    let r = Fs::mount(dev.clone(), Config { check_on_mount: MountCheck::Never, ..test_config() });
    assert_eq!(r.err().map(|e| e.kind), Some(ErrorKind::Corrupt));
    assert!(!clean(&*dev), "a failed mount does not mark the image clean");
    let after = dev.snapshot();
    let changed: Vec<u64> = (0..before.len() as u64 / BLOCK)
        .filter(|b| {
            before[(*b * BLOCK) as usize..((*b + 1) * BLOCK) as usize]
                != after[(*b * BLOCK) as usize..((*b + 1) * BLOCK) as usize]
        })
        .collect();
    // Only the journal's header, which the mount of an image not known clean writes
    // first (its recovery, before anything is checked: the next sequence number).
    assert!(
        changed.iter().all(|b| *b == sb.journal_start),
        "a failed mount writes nothing more: blocks {changed:?} changed (journal header at {})",
        sb.journal_start
    );
}
