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
