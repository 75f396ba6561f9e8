//! The two run-time switches: a shutdown (`Fs::go_down`, XFS_IOC_GOINGDOWN) leaves the
//! image as a power cut would — nothing reaches the medium after it, every operation
//! fails with EIO, the unmount writes nothing, and the next mount recovers every
//! fsync'd byte — and a remount read-only (`Fs::set_read_only`) commits and marks the
//! image clean, refuses changes, and takes them again when turned back.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::device::Device;
use pwfs::{Fs, GoingDown, MkfsOptions};
use std::sync::Arc;

fn clean(dev: &dyn Device) -> bool {
    pwfs::fs::read_superblock(dev).unwrap().0.clean
}

fn fresh() -> (Arc<MemDevice>, Fs) {
    let dev = Arc::new(MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    (dev, fs)
}

#[test]
fn nologflush_drops_what_is_not_durable_and_the_next_mount_recovers() {
    let (dev, fs) = fresh();
    let a: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    fs.create_dir("/d", 0o755).unwrap();
    let f = fs.create("/d/a").unwrap();
    f.write_at(&a, 0).unwrap();
    f.sync_all().unwrap();
    // Not durable: a new file, an overwrite of the synced one, a new directory.
    fs.write_file("/b", &[5; 50_000]).unwrap();
    f.write_at(&[9; 4096], 8192).unwrap();
    fs.create_dir("/unsynced", 0o755).unwrap();
    fs.go_down(GoingDown::NoLogFlush).unwrap();
    assert!(fs.is_down());
    assert!(fs.poisoned().unwrap().contains("shut down"), "{:?}", fs.poisoned());
    let at_the_cut = dev.snapshot();
    // Everything fails with EIO, reads of cached data included.
    assert_eq!(errno(fs.read_file("/d/a")), libc::EIO);
    assert_eq!(errno(fs.metadata("/d/a")), libc::EIO);
    assert_eq!(errno(fs.read_dir("/d")), libc::EIO);
    assert_eq!(errno(fs.write_file("/c", b"x")), libc::EIO);
    assert_eq!(errno(f.write_at(b"x", 0)), libc::EIO);
    assert_eq!(errno(f.sync_all()), libc::EIO);
    assert_eq!(errno(fs.sync()), libc::EIO);
    assert_eq!(errno(fs.create_dir("/e", 0o755)), libc::EIO);
    // A second shutdown is harmless.
    fs.go_down(GoingDown::NoLogFlush).unwrap();
    drop(f);
    fs.unmount().unwrap();
    assert!(dev.snapshot() == at_the_cut, "the medium changed after the shutdown");
    assert!(!clean(&*dev), "a shut-down image must not be marked clean");
    fsck_clean(&*dev);
    let (fs, report) = Fs::mount_report(dev.clone(), test_config()).unwrap();
    assert!(report.transactions_replayed > 0, "{report:?}");
    assert_eq!(fs.read_file("/d/a").unwrap(), a);
    assert_eq!(errno(fs.metadata("/b")), libc::ENOENT);
    assert_eq!(errno(fs.metadata("/unsynced")), libc::ENOENT);
    fs.write_file("/after", b"works").unwrap();
    fs.unmount().unwrap();
    assert!(clean(&*dev));
    fsck_clean(&*dev);
}

#[test]
fn logflush_and_default_commit_before_they_shut_down() {
    for mode in [GoingDown::LogFlush, GoingDown::Default] {
        let (dev, fs) = fresh();
        fs.write_file("/b", &[5; 50_000]).unwrap();
        fs.create_dir("/dir", 0o700).unwrap();
        fs.go_down(mode).unwrap();
        assert_eq!(errno(fs.read_file("/b")), libc::EIO, "{mode:?}");
        fs.unmount().unwrap();
        assert!(!clean(&*dev), "{mode:?}");
        fsck_clean(&*dev);
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        assert_eq!(fs.read_file("/b").unwrap(), vec![5; 50_000], "{mode:?}");
        assert!(fs.metadata("/dir").unwrap().is_dir(), "{mode:?}");
        fs.unmount().unwrap();
    }
    assert_eq!(GoingDown::from_flags(2), Some(GoingDown::NoLogFlush));
    assert_eq!(GoingDown::from_flags(3), None);
}

#[test]
fn remount_read_only_commits_marks_clean_refuses_changes_and_turns_back() {
    let (dev, fs) = fresh();
    fs.write_file("/a", &[1; 10_000]).unwrap();
    fs.sync().unwrap();
    assert!(!clean(&*dev));
    fs.write_file("/a2", &[2; 5_000]).unwrap();
    fs.set_read_only(true).unwrap();
    assert!(fs.is_read_only() && !fs.is_down());
    // Committed, checkpointed and marked clean while still mounted.
    assert!(clean(&*dev));
    fsck_clean(&*dev);
    let before = dev.snapshot();
    assert_eq!(errno(fs.write_file("/b", b"x")), libc::EROFS);
    assert_eq!(errno(fs.create_dir("/d", 0o755)), libc::EROFS);
    assert_eq!(errno(fs.remove_file("/a")), libc::EROFS);
    assert_eq!(fs.read_file("/a").unwrap(), vec![1; 10_000]);
    assert_eq!(fs.read_file("/a2").unwrap(), vec![2; 5_000]);
    fs.sync().unwrap();
    assert!(dev.snapshot() == before, "a read-only file system wrote");
    fs.set_read_only(false).unwrap();
    assert!(!fs.is_read_only());
    fs.write_file("/b", b"back").unwrap();
    fs.sync().unwrap();
    assert!(!clean(&*dev), "the clean mark goes before the first change");
    fs.unmount().unwrap();
    assert!(clean(&*dev));
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/b").unwrap(), b"back");
    assert_eq!(fs.read_file("/a2").unwrap(), vec![2; 5_000]);
    fs.unmount().unwrap();
}
