//! Fault injection and bad input: device errors poison the file system instead of
//! losing writes silently; damaged, truncated or foreign images are refused
//! unchanged; a full device stays consistent and usable.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::device::sim::{SimConfig, SimDevice};
use pwfs::{Config, ErrorKind, Fs, MkfsOptions, MountCheck, OpenOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

#[test]
fn write_error_poisons_and_nothing_is_lost_silently() {
    for (what, cfg) in [
        ("write", SimConfig { fail_writes_after: Some(0), ..Default::default() }),
        ("flush", SimConfig { flush_fail: 1.0, ..Default::default() }),
    ] {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), test_config());
        fs.write_file("/kept", b"durable").unwrap();
        fs.sync().unwrap();
        fs.write_file("/lost", b"never durable").unwrap();
        dev.set_config(cfg);
        let e = fs.sync().expect_err("sync must report the failed device");
        assert_eq!(e.errno(), libc::EIO, "{what}: {e}");
        assert!(fs.poisoned().is_some(), "{what}: file system turned read-only");
        // A later sync or fsync (a background failure has no caller of its own) says
        // EIO too, not EROFS, which callers of fsync take for "cannot be synced".
        assert_eq!(errno(fs.sync()), libc::EIO, "{what}: a later sync");
        let f = OpenOptions::new().read(true).open(&fs, "/lost").unwrap();
        assert_eq!(errno(f.sync_all()), libc::EIO, "{what}: a later fsync");
        assert_eq!(errno(f.sync_data()), libc::EIO, "{what}: a later fdatasync");
        drop(f);
        assert_eq!(errno(fs.write_file("/more", b"x")), libc::EROFS, "{what}");
        assert_eq!(errno(fs.create_dir("/d", 0o755)), libc::EROFS, "{what}");
        assert_eq!(fs.read_file("/kept").unwrap(), b"durable", "{what}: reads go on");
        assert_eq!(errno(fs.clone().unmount()), libc::EROFS, "{what}: unmount says it could not flush");
        drop(fs);
        // What reached the medium is the state of the last good sync.
        dev.set_config(SimConfig::default());
        let img = dev.snapshot();
        let (dev2, fs) = sim_fs(img, SimConfig::default(), test_config());
        assert_eq!(fs.read_file("/kept").unwrap(), b"durable");
        assert_eq!(errno(fs.read_file("/lost")), libc::ENOENT, "{what}: the failed commit is not visible");
        fs.unmount().unwrap();
        fsck_clean(&*dev2);
        // On a read-only mount there is nothing to make durable: fsync and sync say 0.
        let fs = Fs::mount(dev2.clone(), Config { read_only: true, ..test_config() }).unwrap();
        let f = OpenOptions::new().read(true).open(&fs, "/kept").unwrap();
        f.sync_all().unwrap();
        f.sync_data().unwrap();
        drop(f);
        fs.sync().unwrap();
        fs.unmount().unwrap();
    }
}

#[test]
fn read_error_is_reported_and_not_fatal() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, SimConfig::default(), test_config());
    fs.write_file("/f", &vec![7u8; 50_000]).unwrap();
    fs.evict_cache().unwrap();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    assert_eq!(errno(fs.read_file("/f")), libc::EIO);
    dev.set_config(SimConfig::default());
    assert!(fs.poisoned().is_none(), "a failed read does not poison");
    assert_eq!(fs.read_file("/f").unwrap(), vec![7u8; 50_000], "the page is fetched again");
    fs.unmount().unwrap();
}

/// A write stopped by a page it cannot read gives back the space it reserved for the
/// pages after it, also for one that was in the cache already (a hole read as zeros,
/// which stays clean): before, that reservation stayed until the file was truncated
/// or deleted, and the file system ran out of space early.
#[test]
fn a_write_stopped_by_a_failed_read_gives_back_what_it_reserved() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, SimConfig::default(), Config { fetch: pwfs::FetchPolicy::Blocking, ..test_config() });
    fs.write_file("/f", &[1u8; 4096]).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    // Pages 1 and 2 a hole; page 2 cached (as zeros, clean), page 0 on disk only.
    f.set_len(3 * 4096).unwrap();
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    let mut page = vec![9u8; 4096];
    assert_eq!(f.read_at(&mut page, 2 * 4096).unwrap(), 4096);
    assert!(page.iter().all(|b| *b == 0));
    let before = fs.statfs();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    assert_eq!(errno(f.write_at(&vec![5u8; 3 * 4096 - 100], 100)), libc::EIO, "page 0 cannot be read");
    dev.set_config(SimConfig::default());
    let after = fs.statfs();
    assert_eq!((after.blocks_free, after.blocks_available), (before.blocks_free, before.blocks_available));
    // And the write, once it can read, reserves and uses them as any.
    f.write_at(&vec![5u8; 3 * 4096 - 100], 100).unwrap();
    f.sync_all().unwrap();
    let mut want = vec![1u8; 100];
    want.extend(vec![5u8; 3 * 4096 - 100]);
    assert_eq!(fs.read_file("/f").unwrap(), want);
    assert_eq!(fs.statfs().blocks_free, before.blocks_free - 2);
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A truncate whose tail page cannot be read fails with EIO and leaves the file as it
/// was: its dirty pages past the new end (never written back) are still there.
#[test]
fn a_truncate_that_cannot_read_its_tail_changes_nothing() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, SimConfig::default(), test_config());
    fs.write_file("/f", &vec![7u8; 3 * 4096]).unwrap();
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    // Dirty pages 2..4 (written whole: no read), page 0 and 1 on disk only.
    let f = OpenOptions::new().write(true).open(&fs, "/f").unwrap();
    f.write_at(&vec![9u8; 2 * 4096], 2 * 4096).unwrap();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    assert_eq!(errno(f.set_len(4096 + 100)), libc::EIO, "the tail page (1) cannot be read");
    dev.set_config(SimConfig::default());
    let mut want = vec![7u8; 2 * 4096];
    want.extend(vec![9u8; 2 * 4096]);
    let got = fs.read_file("/f").unwrap();
    assert!(
        got == want,
        "a failed truncate dropped written pages ({} bytes, {} of them 9)",
        got.len(),
        got.iter().filter(|b| **b == 9).count()
    );
    drop(f);
    fs.unmount().unwrap();
}

#[test]
fn random_faults_never_panic_and_never_lie() {
    // Seeds whose check had synced files to look at (a seed whose first sync failed
    // checks nothing).
    let mut checked = 0;
    for seed in 0..20u64 {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), test_config());
        dev.set_config(SimConfig { seed, read_fail: 0.02, write_fail: 0.02, flush_fail: 0.02, ..Default::default() });
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut synced: Vec<(String, Vec<u8>)> = Vec::new();
        let mut pending: Vec<(String, Vec<u8>)> = Vec::new();
        for i in 0..200 {
            let path = format!("/f{i}");
            let data = vec![rng.gen::<u8>(); rng.gen_range(0..20_000)];
            if fs.write_file(&path, &data).is_ok() {
                pending.push((path, data));
            }
            if i % 10 == 9 {
                match fs.sync() {
                    Ok(()) => synced.append(&mut pending),
                    Err(e) => {
                        assert!(matches!(e.kind(), ErrorKind::Io | ErrorKind::ReadOnly), "seed {seed}: {e}");
                        break;
                    }
                }
            }
        }
        drop(fs);
        // Everything a successful sync promised is on the medium.
        let img = dev.snapshot();
        let (dev2, fs) = sim_fs(img, SimConfig::default(), test_config());
        for (p, d) in &synced {
            assert_eq!(&fs.read_file(p).unwrap(), d, "seed {seed}: {p}");
        }
        checked += !synced.is_empty() as usize;
        fs.unmount().unwrap();
        fsck_clean(&*dev2);
    }
    eprintln!("{checked} of 20 seeds had synced files to check");
    assert!(checked >= 15, "only {checked} of 20 seeds got a sync through: the test checks almost nothing");
}

fn populated_image() -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(8 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(256), journal_blocks: Some(64) }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    fs.create_dir("/d", 0o755).unwrap();
    for i in 0..40 {
        fs.write_file(format!("/d/f{i}"), &vec![i as u8; i * 700]).unwrap();
    }
    fs.symlink_path("d/f1", "/s").unwrap();
    fs.unmount().unwrap();
    dev.snapshot()
}

#[test]
fn corrupt_images_are_refused_unchanged_or_mount_clean() {
    let good = populated_image();
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    let meta_end = (sb.data_start as usize + 64) * 4096;
    let (mut refused, mut mounted) = (0, 0);
    for seed in 0..300u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut img = good.clone();
        for _ in 0..rng.gen_range(1..8) {
            // Mostly metadata (superblock, journal, bitmaps, inodes, first directory
            // blocks), sometimes anywhere.
            let at = if rng.gen_bool(0.8) { rng.gen_range(0..meta_end) } else { rng.gen_range(0..img.len()) };
            img[at] ^= rng.gen_range(1..=255u8);
        }
        let dev = Arc::new(SimDevice::new(img.clone(), SimConfig::default()));
        // The image was unmounted cleanly: only a check asked for reads all of it.
        match Fs::mount(dev.clone(), Config { check_on_mount: MountCheck::Always, ..test_config() }) {
            Err(e) => {
                refused += 1;
                assert!(!e.to_string().is_empty());
                assert!(dev.snapshot() == img, "seed {seed}: a refused mount changed the image");
            }
            Ok(fs) => {
                mounted += 1;
                for e in fs.read_dir("/d").unwrap_or_default() {
                    let _ = fs.read_file(format!("/d/{}", String::from_utf8_lossy(&e.name)));
                }
                fs.unmount().unwrap();
                let r = pwfs::fsck::check(&*dev).unwrap();
                assert!(r.is_clean(), "seed {seed}: mounted, but fsck then finds: {:?}", r.errors);
            }
        }
    }
    assert!(refused > 0 && mounted > 0, "refused {refused}, mounted {mounted}");
}

#[test]
fn truncated_and_foreign_images_are_refused() {
    let good = populated_image();
    let short = MemDevice::from_vec(good[..good.len() / 2].to_vec());
    let e = Fs::mount(Arc::new(short), test_config()).unwrap_err();
    assert!(e.to_string().contains("truncated") || e.kind() == ErrorKind::Corrupt, "{e}");
    let zeros = Arc::new(MemDevice::new(8 * MIB));
    let e = Fs::mount(zeros, test_config()).unwrap_err();
    assert!(e.to_string().contains("not a pwfs image"), "{e}");
    let mut rng = SmallRng::seed_from_u64(5);
    let noise: Vec<u8> = (0..8 * MIB).map(|_| rng.gen()).collect();
    assert_eq!(Fs::mount(Arc::new(MemDevice::from_vec(noise)), test_config()).unwrap_err().kind(), ErrorKind::Corrupt);
    let tiny = Arc::new(MemDevice::new(4096 * 8));
    assert!(Fs::mount(tiny, test_config()).is_err());
    assert!(pwfs::mkfs(&MemDevice::new(4096 * 8), &MkfsOptions::default()).is_err());
}

#[test]
fn damaged_primary_superblock_falls_back_to_the_backup() {
    let mut img = populated_image();
    img[100] ^= 0xff;
    let dev = Arc::new(MemDevice::from_vec(img));
    let (fs, report) =
        Fs::mount_report(dev.clone(), Config { check_on_mount: MountCheck::Never, ..test_config() }).unwrap();
    assert!(report.used_backup_superblock);
    assert_eq!(fs.read_file("/d/f3").unwrap(), vec![3u8; 2100]);
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert!(r.errors.iter().any(|e| e.contains("primary superblock")), "fsck reports it: {:?}", r.errors);
}

#[test]
fn a_writable_mount_that_checked_the_image_rewrites_a_damaged_primary_superblock() {
    use pwfs::format::Superblock;
    let mut img = populated_image();
    img[100] ^= 0xff;
    let dev = Arc::new(MemDevice::from_vec(img));
    // Read-only: nothing is written, the damage stays for fsck to report.
    let (fs, report) = Fs::mount_report(dev.clone(), Config { read_only: true, ..test_config() }).unwrap();
    assert!(report.used_backup_superblock);
    drop(fs);
    assert!(Superblock::decode(&dev.snapshot()[..4096]).is_err());
    // Writable, with the full check (the default for an image not known clean): the
    // primary is rewritten from the backup, and the image ends clean again.
    let (fs, report) =
        Fs::mount_report(dev.clone(), Config { check_on_mount: MountCheck::IfNotClean, ..test_config() }).unwrap();
    assert!(report.used_backup_superblock);
    assert_eq!(fs.read_file("/d/f3").unwrap(), vec![3u8; 2100]);
    fs.write_file("/after", b"written on the restored image").unwrap();
    fs.unmount().unwrap();
    let sb = Superblock::decode(&dev.snapshot()[..4096]).expect("the primary is whole again");
    assert!(sb.clean, "unmounted clean");
    let r = pwfs::fsck::check(&*dev).unwrap();
    assert!(r.is_clean(), "{:?}", r.errors);
    let (fs, report) = Fs::mount_report(dev, test_config()).unwrap();
    assert!(!report.used_backup_superblock);
    assert_eq!(fs.read_file("/after").unwrap(), b"written on the restored image");
}

#[test]
fn enospc_leaves_a_consistent_usable_file_system() {
    let dev = Arc::new(MemDevice::new(4 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(1024), journal_blocks: Some(64) }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let mut written = 0;
    let chunk = vec![0xabu8; 64 * 1024];
    let err = loop {
        let path = format!("/f{written}");
        match fs.write_file(&path, &chunk) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert!(written > 10);
    fs.sync().unwrap();
    assert!(fs.statfs().blocks_available < 16);
    // Names still work where no space is needed; the data written is intact.
    assert_eq!(fs.read_file("/f0").unwrap(), chunk);
    for i in 0..written {
        fs.remove_file(format!("/f{i}")).unwrap();
    }
    let _ = fs.remove_file(format!("/f{written}"));
    // Space comes back (after the commit that frees it) and can be used again.
    for i in 0..written {
        fs.write_file(format!("/g{i}"), &chunk).unwrap();
    }
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    // A full inode table is ENOSPC too.
    let dev = Arc::new(MemDevice::new(4 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(32), journal_blocks: Some(64) }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let mut n = 0;
    let e = loop {
        match OpenOptions::new().write(true).create_new(true).open(&fs, format!("/i{n}")) {
            Ok(_) => n += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(e.errno(), libc::ENOSPC);
    assert_eq!(n, 31, "every inode but the root's");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// fsck finds each kind of damage (so that "fsck clean" in the other tests means
/// something): a block in use marked free, a wrong link count, a directory entry
/// pointing at a free inode, a bad checksum.
#[test]
fn fsck_reports_each_kind_of_damage() {
    use pwfs::format::{self as f, DiskInode, BLOCK};
    let good = populated_image();
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    assert!(pwfs::fsck::check(&MemDevice::from_vec(good.clone())).unwrap().is_clean());
    let block = |b: u64| (b * BLOCK) as usize..((b + 1) * BLOCK) as usize;
    // The inode of /d/f5 (a file with data) and its first data block.
    let fs = Fs::mount(Arc::new(MemDevice::from_vec(good.clone())), test_config()).unwrap();
    let ino = fs.metadata("/d/f5").unwrap().ino;
    drop(fs);
    let (tblk, off) = (
        sb.inode_table_start + (ino - 1) / f::INODES_PER_BLOCK,
        ((ino - 1) % f::INODES_PER_BLOCK) as usize * f::INODE_SIZE,
    );
    let inode = |img: &[u8]| DiskInode::decode(ino, &img[block(tblk)][off..off + f::INODE_SIZE]).unwrap().unwrap();
    let data_blk = inode(&good).extents[0].physical;
    let errors = |img: Vec<u8>| pwfs::fsck::check(&MemDevice::from_vec(img)).unwrap().errors;
    let reported = |errors: &[String], what: &str| {
        assert!(errors.iter().any(|e| e.contains(what)), "expected {what:?} in {errors:?}");
    };

    let mut img = good.clone();
    let bm = sb.block_bitmap_start + data_blk / f::BITS_PER_BITMAP_BLOCK;
    let bit = data_blk % f::BITS_PER_BITMAP_BLOCK;
    let r = block(bm);
    img[r.clone()][(bit / 8) as usize] &= !(1 << (bit % 8));
    f::bitmap_seal(&mut img[r], bm - sb.block_bitmap_start);
    reported(&errors(img), &format!("block {data_blk} of inode {ino} is marked free"));

    let mut img = good.clone();
    let mut d = inode(&img);
    d.nlink = 3;
    let r = block(tblk);
    d.encode(ino, &mut img[r][off..off + f::INODE_SIZE]);
    reported(&errors(img), &format!("inode {ino}: link count 3 but 1 names"));

    let mut img = good.clone();
    let r = block(tblk);
    img[r][off..off + f::INODE_SIZE].fill(0);
    let ib = sb.inode_bitmap_start;
    let r = block(ib);
    img[r.clone()][((ino - 1) / 8) as usize] &= !(1 << ((ino - 1) % 8));
    f::bitmap_seal(&mut img[r], 0);
    let errs = errors(img);
    reported(&errs, &format!("points at free inode {ino}"));
    reported(&errs, "leaked"); // its blocks are now owned by nobody

    let mut img = good.clone();
    let r = block(tblk);
    img[r][off + 20] ^= 0x40;
    let errs = errors(img);
    assert!(errs.iter().any(|e| e.contains(&format!("inode {ino}")) && e.contains("checksum")), "{errs:?}");
}

/// A damaged image mounted without the full check (the default for an image marked
/// clean) and then used — reads, writes, creates, renames, deletes — never panics:
/// each operation succeeds or fails with an errno, and unmount does one or the other.
#[test]
fn damaged_images_used_without_a_check_never_panic() {
    // Two images: one unmounted cleanly, one shut down with committed transactions
    // still in its journal (the next mount checks the image and replays them).
    let good = populated_image();
    let crashed = {
        let dev = Arc::new(MemDevice::from_vec(good.clone()));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        for i in 0..10 {
            fs.write_file(format!("/d/j{i}"), &vec![9u8; 3000]).unwrap();
            fs.rename_path(format!("/d/f{i}"), format!("/d/g{i}")).unwrap();
        }
        fs.go_down(pwfs::GoingDown::LogFlush).unwrap();
        drop(fs);
        dev.snapshot()
    };
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    let meta_end = (sb.data_start as usize + 64) * 4096;
    // Panics of the engine's own threads (write-back, fetcher, readahead) count too.
    static THREAD_PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        THREAD_PANICS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        hook(info)
    }));
    let mut panics = Vec::new();
    let (mut refused, mut clean, mut failed) = (0, 0, 0);
    for seed in 0..400u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut img = if seed % 2 == 0 { good.clone() } else { crashed.clone() };
        for _ in 0..rng.gen_range(1..4) {
            // Blocks in use: the bitmaps, the first inode table blocks, the first
            // blocks of the data area (directory and extent blocks, file data).
            let block = |b: u64| b as usize * 4096;
            let at = match rng.gen_range(0..5) {
                4 => rng.gen_range(block(sb.journal_start)..block(sb.journal_start + 16)),
                0 => rng.gen_range(block(sb.inode_bitmap_start)..block(sb.inode_table_start)),
                1 => rng.gen_range(block(sb.inode_table_start)..block(sb.inode_table_start + 4)),
                2 => rng.gen_range(block(sb.data_start)..block(sb.data_start + 48)),
                _ => rng.gen_range(4096..meta_end),
            };
            img[at] ^= rng.gen_range(1..=255u8);
        }
        let r = std::panic::catch_unwind(|| {
            let dev = Arc::new(SimDevice::new(img.clone(), SimConfig::default()));
            let Ok(fs) = Fs::mount(dev.clone(), test_config()) else { return 0 };
            let mut errors = 0;
            for e in fs.read_dir("/d").unwrap_or_default() {
                let p = format!("/d/{}", String::from_utf8_lossy(&e.name));
                let _ = fs.read_file(&p);
                let _ = fs.metadata(&p);
            }
            for i in 0..12 {
                let _ = fs.write_file(format!("/d/n{i}"), &vec![3u8; i * 900]);
                let _ = fs.rename_path(format!("/d/f{i}"), format!("/d/r{i}"));
                let _ = fs.remove_file(format!("/d/f{}", i + 20));
                let _ = fs.create_dir(format!("/d/sub{i}"), 0o755);
                if let Ok(m) = fs.metadata(format!("/d/f{}", i + 12)) {
                    let _ = fs.setxattr(m.ino, b"user.k", b"v", false, false);
                }
            }
            let _ = fs.remove_dir("/d/sub3");
            errors += fs.sync().is_err() as u32;
            errors += fs.unmount().is_err() as u32;
            1 + errors
        });
        match r {
            Err(_) => panics.push(seed),
            Ok(0) => refused += 1,
            Ok(1) => clean += 1,
            Ok(_) => failed += 1,
        }
    }
    eprintln!("refused {refused}, used cleanly {clean}, failed at sync or unmount {failed}");
    assert!(panics.is_empty(), "panicked on seeds {panics:?}");
    assert_eq!(THREAD_PANICS.load(std::sync::atomic::Ordering::Relaxed), 0, "an engine thread panicked");
}

/// Bytes of block `b` in an image.
fn block_range(b: u64) -> std::ops::Range<usize> {
    (b * pwfs::format::BLOCK) as usize..((b + 1) * pwfs::format::BLOCK) as usize
}

/// Bytes of inode `ino`'s slot in an image of superblock `sb`.
fn inode_range(sb: &pwfs::format::Superblock, ino: u64) -> std::ops::Range<usize> {
    use pwfs::format as f;
    let r = block_range(sb.inode_table_start + (ino - 1) / f::INODES_PER_BLOCK);
    let off = r.start + ((ino - 1) % f::INODES_PER_BLOCK) as usize * f::INODE_SIZE;
    off..off + f::INODE_SIZE
}

/// Inode `ino` of an image, decoded.
fn get_inode(img: &[u8], sb: &pwfs::format::Superblock, ino: u64) -> pwfs::format::DiskInode {
    pwfs::format::DiskInode::decode(ino, &img[inode_range(sb, ino)]).unwrap().unwrap()
}

/// Change inode `ino` of an image in place (encoded again, checksum included).
fn edit_inode(img: &mut [u8], sb: &pwfs::format::Superblock, ino: u64, change: &dyn Fn(&mut pwfs::format::DiskInode)) {
    let mut d = get_inode(img, sb, ino);
    change(&mut d);
    d.encode(ino, &mut img[inode_range(sb, ino)]);
}

/// Fields a damaged or crafted image can hold that decode on their own but break an
/// invariant the engine relies on: each is an error (mount refused, fsck finding, or
/// a corrupt-image errno from the call), never a panic, a hang or silent damage.
#[test]
fn crafted_fields_are_errors_not_panics() {
    use pwfs::format::{self as f, DiskInode, ExtentBlock, JournalHeader};
    let good = {
        let dev = Arc::new(MemDevice::from_vec(populated_image()));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        fs.create_dir("/e", 0o755).unwrap();
        fs.unmount().unwrap();
        dev.snapshot()
    };
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    let block = block_range;
    let fs = Fs::mount(Arc::new(MemDevice::from_vec(good.clone())), test_config()).unwrap();
    let (file, dir) = (fs.metadata("/d/f5").unwrap().ino, fs.metadata("/d").unwrap().ino);
    drop(fs);
    let slot = |ino: u64| inode_range(&sb, ino);
    let edit = |img: &mut Vec<u8>, ino: u64, change: &dyn Fn(&mut DiskInode)| edit_inode(img, &sb, ino, change);
    let fsck_finds = |img: &[u8], what: &str| {
        let r = pwfs::fsck::check(&MemDevice::from_vec(img.to_vec())).unwrap();
        assert!(!r.is_clean(), "{what}: fsck found nothing");
    };
    let checked_mount_refused = |img: &[u8], what: &str| {
        let dev = Arc::new(MemDevice::from_vec(img.to_vec()));
        let r = Fs::mount(dev, Config { check_on_mount: MountCheck::Always, ..test_config() });
        assert!(r.is_err(), "{what}: a checked mount accepted it");
    };

    // An extent chain block far past the device: fsck reports it (it read it before).
    let mut img = good.clone();
    edit(&mut img, file, &|d| {
        d.n_extents = f::INLINE_EXTENTS as u32 + 1;
        d.ext_block = 1 << 60;
    });
    fsck_finds(&img, "chain block past the device");
    checked_mount_refused(&img, "chain block past the device");

    // A journal header whose sequence number is at the top of u64.
    let mut img = good.clone();
    JournalHeader { start_seq: u64::MAX }.encode(&mut img[block(sb.journal_start)]);
    checked_mount_refused(&img, "sequence number u64::MAX");
    assert!(Fs::mount(Arc::new(MemDevice::from_vec(img.clone())), test_config()).is_err());
    assert!(pwfs::fsck::check(&MemDevice::from_vec(img)).is_err_or_unclean());

    // A regular file flagged as holding inline data: its first write would have stored
    // extents the inode then dropped.
    let mut img = good.clone();
    edit(&mut img, file, &|d| {
        d.flags |= f::INODE_FLAG_INLINE;
        d.size = 10;
        d.n_extents = 0;
        d.extents.clear();
        d.inline = vec![1; 10];
        d.blocks = 0;
    });
    assert!(DiskInode::decode(file, &img[slot(file)]).is_err());
    fsck_finds(&img, "inline regular file");

    // An extent chain whose block points at itself, on an image marked clean (mounted
    // without the full check): reading the file is an error, and so is unmount or not,
    // but nothing is freed twice.
    let mut img = good.clone();
    let spare = sb.data_end - 8;
    let k = 2u32;
    let extents: Vec<f::Extent> = (0..f::EXTENTS_PER_BLOCK as u32)
        .map(|i| f::Extent { logical: 1000 + i, len: 1, physical: sb.data_end - 9, unwritten: false })
        .collect();
    ExtentBlock { ino: file, next: spare, extents }.encode(&mut img[block(spare)]);
    edit(&mut img, file, &|d| {
        d.n_extents = f::INLINE_EXTENTS as u32 + k * f::EXTENTS_PER_BLOCK as u32;
        d.ext_block = spare;
    });
    let fs = Fs::mount(Arc::new(MemDevice::from_vec(img.clone())), test_config()).unwrap();
    let e = fs.read_file("/d/f5").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let _ = fs.unmount();
    fsck_finds(&img, "extent chain loop");

    // The root with no links left: never freed as an orphan. fsck reports it, and a
    // mount refuses it, checked or not, clean or not.
    let mut img = good.clone();
    edit(&mut img, f::ROOT_INO, &|d| d.nlink = 0);
    fsck_finds(&img, "root with link count 0");
    for check in [MountCheck::Never, MountCheck::IfNotClean, MountCheck::Always] {
        let r =
            Fs::mount(Arc::new(MemDevice::from_vec(img.clone())), Config { check_on_mount: check, ..test_config() });
        assert!(r.is_err(), "{check:?}: a root with link count 0 mounted");
    }

    // A directory whose link count is at the top of u32: a directory exchanged into
    // it is EMLINK, not an overflow.
    let mut img = good.clone();
    edit(&mut img, dir, &|d| d.nlink = u32::MAX);
    let fs = Fs::mount(Arc::new(MemDevice::from_vec(img.clone())), test_config()).unwrap();
    let e = fs.rename_exchange(f::ROOT_INO, b"e", dir, b"f5").unwrap_err();
    assert_eq!(e.errno(), libc::EMLINK, "{e}");
    let _ = fs.unmount();

    // A directory that is its own parent: moving a directory into it must not loop.
    let mut img = good.clone();
    edit(&mut img, dir, &|d| d.parent = dir);
    let fs = Fs::mount(Arc::new(MemDevice::from_vec(img.clone())), test_config()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let fs2 = fs.clone();
    std::thread::spawn(move || {
        let _ = tx.send(fs2.rename_path("/e", "/d/e").map_err(|e| e.kind()));
    });
    let r = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("rename into a parent loop hung");
    assert_eq!(r, Err(ErrorKind::Corrupt));
    let _ = fs.unmount();
}

trait ErrOrUnclean {
    fn is_err_or_unclean(&self) -> bool;
}

impl ErrOrUnclean for pwfs::Result<pwfs::fsck::Report> {
    fn is_err_or_unclean(&self) -> bool {
        self.as_ref().map_or(true, |r| !r.is_clean())
    }
}

/// An image whose device grew after mkfs (a file extended, a volume resized) checks
/// clean: its backup superblock is at the image's end, not the device's.
#[test]
fn a_grown_device_checks_clean() {
    let mut img = populated_image();
    img.resize(img.len() + 4 * MIB as usize, 0);
    let dev = Arc::new(MemDevice::from_vec(img));
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), Config { check_on_mount: MountCheck::Always, ..test_config() }).unwrap();
    assert_eq!(fs.read_file("/d/f3").unwrap(), vec![3u8; 3 * 700]);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Damage that left every count consistent, so that fsck passed it before: names in
/// a removed directory (the mount would free the directory and leave the names'
/// inodes a link too many), an entry naming the root (a loop of directories), and
/// an extent chain that comes back to its own block under a count of 2^32 - 1
/// extents (fsck read it until memory ran out).
#[test]
fn fsck_finds_damage_that_keeps_the_counts_right() {
    use pwfs::format::{self as f, DiskInode, ExtentBlock};
    let good = {
        let dev = Arc::new(MemDevice::from_vec(populated_image()));
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        fs.create_dir("/o", 0o755).unwrap();
        fs.create_dir("/o2", 0o755).unwrap();
        fs.write_file("/a", b"a").unwrap();
        fs.hard_link("/a", "/o/F").unwrap();
        fs.hard_link("/a", "/o2/y").unwrap();
        fs.unmount().unwrap();
        dev.snapshot()
    };
    fsck_clean(&MemDevice::from_vec(good.clone()));
    let sb = pwfs::fs::read_superblock(&MemDevice::from_vec(good.clone())).unwrap().0;
    let block = block_range;
    let fs = Fs::mount(Arc::new(MemDevice::from_vec(good.clone())), test_config()).unwrap();
    let ino = |p: &str| fs.metadata(p).unwrap().ino;
    let (o, o2, a, file) = (ino("/o"), ino("/o2"), ino("/a"), ino("/d/f5"));
    drop(fs);
    let get = |img: &[u8], ino: u64| get_inode(img, &sb, ino);
    let edit = |img: &mut Vec<u8>, ino: u64, change: &dyn Fn(&mut DiskInode)| edit_inode(img, &sb, ino, change);
    // Rewrite the entries of directory `dir`'s first block.
    let entries = |img: &mut Vec<u8>, dir: u64, change: &dyn Fn(&mut Vec<Option<f::Dirent>>)| {
        let b = get(img, dir).extents[0].physical;
        let mut slots = f::dir_block_decode(dir, &img[block(b)]).unwrap();
        change(&mut slots);
        f::dir_block_encode(dir, &slots, &mut img[block(b)]);
    };
    let found = |img: &[u8], what: &str| {
        let r = pwfs::fsck::check(&MemDevice::from_vec(img.to_vec())).unwrap();
        assert!(!r.is_clean(), "{what}: fsck found nothing");
        r
    };

    // /o unlinked (link count 0, no name: an orphan) while it still names /a as F.
    let mut img = good.clone();
    edit(&mut img, o, &|d| d.nlink = 0);
    entries(&mut img, f::ROOT_INO, &|s| {
        for e in s.iter_mut() {
            if e.as_ref().is_some_and(|e| e.name == b"o") {
                *e = None;
            }
        }
    });
    edit(&mut img, f::ROOT_INO, &|d| d.nlink -= 1);
    let r = found(&img, "names in a removed directory");
    assert!(r.errors.iter().any(|e| e.contains("removed directory")), "{:?}", r.errors);

    // /o2/y names the root instead of /a (o2 counts one more subdirectory, /a one name
    // less).
    let mut img = good.clone();
    entries(&mut img, o2, &|s| {
        for e in s.iter_mut().flatten() {
            if e.name == b"y" {
                e.ino = f::ROOT_INO;
                e.ftype = 4;
            }
        }
    });
    edit(&mut img, o2, &|d| d.nlink += 1);
    edit(&mut img, a, &|d| d.nlink -= 1);
    let r = found(&img, "an entry naming the root");
    assert!(r.errors.iter().any(|e| e.contains("root")), "{:?}", r.errors);

    // An access ACL the engine cannot decode (a version it does not know), in an
    // attribute block that is otherwise whole.
    let mut img = good.clone();
    let dev = Arc::new(MemDevice::from_vec(img.clone()));
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    fs.setxattr(a, b"user.x", b"1", false, false).unwrap();
    fs.unmount().unwrap();
    img.copy_from_slice(&dev.snapshot());
    let head = get(&img, a).xattr_block;
    assert_ne!(head, 0);
    let bad_acl = [9u8, 0, 0, 0, 1, 0, 6, 0, 0, 0, 0, 0];
    let entries = vec![(b"system.posix_acl_access".to_vec(), bad_acl.to_vec()), (b"user.x".to_vec(), b"1".to_vec())];
    let blocks = f::xattr_encode(a, &entries, &[head]);
    img[block(head)].copy_from_slice(&blocks[0]);
    let r = found(&img, "an ACL that does not decode");
    assert!(r.errors.iter().any(|e| e.contains("posix_acl_access")), "{:?}", r.errors);

    // An extent block pointing at itself, under the largest extent count.
    let mut img = good.clone();
    let spare = sb.data_end - 8;
    let extents: Vec<f::Extent> = (0..f::EXTENTS_PER_BLOCK as u32)
        .map(|i| f::Extent { logical: 1000 + i, len: 1, physical: sb.data_end - 9, unwritten: false })
        .collect();
    ExtentBlock { ino: file, next: spare, extents }.encode(&mut img[block(spare)]);
    edit(&mut img, file, &|d| {
        d.n_extents = u32::MAX;
        d.ext_block = spare;
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(pwfs::fsck::check(&MemDevice::from_vec(img)).map(|r| r.is_clean()));
    });
    let clean = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("fsck of a looping chain did not end");
    assert_eq!(clean.ok(), Some(false));
}

/// A write that runs out of space after writing some of its data returns the bytes it
/// wrote (a short count, as write(2)), which are in the file; only a write that
/// writes nothing fails, with ENOSPC.
#[test]
fn a_write_that_runs_out_of_space_part_way_is_short() {
    const MIB: usize = 1 << 20;
    let (dev, fs) = mem_fs(16 * MIB as u64);
    let free = fs.statfs().blocks_available as usize * 4096;
    let data: Vec<u8> = (0..free + 8 * MIB).map(|i| (i % 251) as u8).collect();
    let f = pwfs::OpenOptions::new().read(true).write(true).create(true).open(&fs, "/f").unwrap();
    let n = f.write(&data).unwrap();
    assert!(n > 0 && n < data.len() && n.is_multiple_of(4 * MIB), "wrote {n} of {}", data.len());
    assert_eq!(fs.metadata("/f").unwrap().size, n as u64);
    assert_eq!(errno(f.write(&data[n..])), libc::ENOSPC, "nothing more fits");
    assert_eq!(fs.read_file("/f").unwrap(), data[..n]);
    drop(f);
    fs.unmount().unwrap();
    let fs = pwfs::Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/f").unwrap(), data[..n]);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// As Linux: a write that starts below the largest file size writes what fits below
/// it; a write at or past it fails with EFBIG.
#[test]
fn a_write_across_the_largest_file_size_writes_what_fits() {
    let (_dev, fs) = mem_fs(16 << 20);
    let max = pwfs::format::MAX_FILE_SIZE;
    let f = pwfs::OpenOptions::new().read(true).write(true).create(true).open(&fs, "/f").unwrap();
    assert_eq!(f.write_at(&[7u8; 100], max - 10).unwrap(), 10);
    assert_eq!(fs.metadata("/f").unwrap().size, max);
    assert_eq!(errno(f.write_at(&[7u8; 100], max)), libc::EFBIG);
    assert_eq!(f.write_at(&[], max).unwrap(), 0, "an empty write at the limit");
    let mut back = [0u8; 20];
    assert_eq!(f.read_at(&mut back, max - 20).unwrap(), 20);
    assert_eq!(back, [[0u8; 10], [7u8; 10]].concat()[..]);
}
