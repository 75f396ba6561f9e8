//! Scale and engines: a directory of 100,000 entries, and the whole stack on the
//! io_uring engine over a real image file.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::{Config, Fs, MkfsOptions, OpenOptions};
use std::sync::Arc;

#[test]
fn directory_with_100k_entries() {
    const N: usize = 100_000;
    let dev = Arc::new(MemDevice::new(512 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(N as u64 + 1000), journal_blocks: None }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    fs.create_dir("/big", 0o755).unwrap();
    let dir = fs.metadata("/big").unwrap().ino;
    for i in 0..N {
        fs.mknod(dir, format!("entry-{i:06}").as_bytes(), 0o644, 0, &pwfs::Creator::new(0, 0)).unwrap();
    }
    assert_eq!(errno(fs.mknod(dir, b"entry-000123", 0o644, 0, &pwfs::Creator::new(0, 0))), libc::EEXIST);
    fs.unmount().unwrap();
    let fs = Fs::mount(dev.clone(), Config { check_on_mount: pwfs::MountCheck::Never, ..test_config() }).unwrap();
    for i in (0..N).step_by(997) {
        fs.lookup(dir, format!("entry-{i:06}").as_bytes()).unwrap();
    }
    assert_eq!(errno(fs.lookup(dir, b"entry-x")), libc::ENOENT);
    for i in (0..N).step_by(2) {
        fs.unlink(dir, format!("entry-{i:06}").as_bytes()).unwrap();
    }
    let entries = fs.read_dir("/big").unwrap();
    assert_eq!(entries.len(), N / 2);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn io_uring_image_end_to_end() {
    let dir = std::env::temp_dir().join(format!("pwfs-uring-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("test.img");
    pwfs::mkfs_image(&img, 64 * MIB, &MkfsOptions::default()).unwrap();
    let config = Config { cache_bytes: 2 * MIB, ..test_config() };
    let fs = pwfs::mount_image(&img, config.clone()).unwrap();
    let data: Vec<u8> = (0..5 * MIB as usize).map(|i| (i % 253) as u8).collect();
    fs.write_file("/data", &data).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/data").unwrap();
    f.write_at(b"patch", 12345).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs.unmount().unwrap();
    let fs = pwfs::mount_image(&img, config).unwrap();
    let mut want = data;
    want[12345..12350].copy_from_slice(b"patch");
    assert_eq!(fs.read_file("/data").unwrap(), want);
    // Readers on several threads use their own rings.
    let hs: Vec<_> = (0..3)
        .map(|_| {
            let fs = fs.clone();
            let want = want.clone();
            std::thread::spawn(move || {
                fs.evict_cache().unwrap();
                assert_eq!(fs.read_file("/data").unwrap(), want);
            })
        })
        .collect();
    hs.into_iter().for_each(|h| h.join().unwrap());
    fs.unmount().unwrap();
    let dev = pwfs::open_device(&img, &Config::default()).unwrap();
    fsck_clean(&*dev);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Directories take inode numbers in groups of their own, and their files are
/// numbered next to them: two threads creating in two directories change different
/// table blocks and bitmap words. When no group is empty, numbers come from anywhere,
/// and every number can still be used.
#[test]
fn directories_spread_and_files_stay_near_them() {
    let dev = Arc::new(MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(4096), journal_blocks: None }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let ino = |p: &str| fs.metadata(p).unwrap().ino;
    fs.create_dir("/a", 0o755).unwrap();
    fs.create_dir("/b", 0o755).unwrap();
    let (a, b) = (ino("/a"), ino("/b"));
    assert!(a.abs_diff(b) >= 512, "directories {a} and {b} share an inode group");
    for i in 0..20 {
        fs.write_file(format!("/a/f{i}"), b"x").unwrap();
        fs.write_file(format!("/b/f{i}"), b"y").unwrap();
        let (fa, fb) = (ino(&format!("/a/f{i}")), ino(&format!("/b/f{i}")));
        assert!(fa > a && fa < a + 512, "file {fa} of directory {a}");
        assert!(fb > b && fb < b + 512, "file {fb} of directory {b}");
    }
    // A deleted file's number is the next one its directory hands out.
    let freed = ino("/a/f3");
    fs.remove_file("/a/f3").unwrap();
    fs.write_file("/a/again", b"z").unwrap();
    assert_eq!(ino("/a/again"), freed);
    // More directories than groups, then every inode in use: ENOSPC, not a hang.
    let mut made = 0;
    for i in 0.. {
        let r = if i % 5 == 0 {
            fs.create_dir(format!("/d{i}"), 0o755).map(drop)
        } else {
            fs.write_file(format!("/a/g{i}"), b"").map(drop)
        };
        match r {
            Ok(()) => made += 1,
            Err(e) => {
                assert_eq!(e.errno(), libc::ENOSPC, "{e}");
                break;
            }
        }
    }
    assert!(made > 4000, "only {made} inodes could be made");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}
