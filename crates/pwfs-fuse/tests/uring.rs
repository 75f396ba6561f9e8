//! FUSE over io_uring, through the kernel. A test binary of its own: it turns the fuse
//! module's `enable_uring` on while it runs, which would hand the ring to the mounts of
//! tests running beside it in the same binary (cargo runs test binaries one at a time).
//! Needs root and /dev/fuse (CI has both); elsewhere it says so and does nothing.

mod common;
use common::{can_mount, errno, mount_in};
use pwfs::device::mem::MemDevice;
use pwfs::{Config, Fs, MkfsOptions};
use std::sync::Arc;

/// FUSE over io_uring: with the fuse module's `enable_uring` on at mount time, every
/// serving thread registers a ring entry on its CPU's queue (the session's threads spread
/// over the online CPUs) and requests come through the entries: data both ways, names in
/// the payload, direct reads with replies of many pages, errors. A `dev_fuse_only` mount
/// registers none and serves the same calls through /dev/fuse. Skipped where the kernel
/// has no FUSE over io_uring (before 6.14, or built without it) or io_uring is disabled.
#[test]
fn fuse_over_io_uring_serves_the_mount() {
    use pwfs_fuse::{KernelCache, MountOptions};
    if !can_mount() {
        return;
    }
    if std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").is_ok_and(|v| v.trim() != "0") {
        eprintln!("skipping: io_uring is disabled here");
        return;
    }
    let cpus = |what: &str| -> Vec<usize> {
        let list = std::fs::read_to_string(format!("/sys/devices/system/cpu/{what}")).unwrap();
        list.trim()
            .split(',')
            .flat_map(|p| match p.split_once('-') {
                Some((a, b)) => a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap(),
                None => p.parse::<usize>().unwrap()..=p.parse::<usize>().unwrap(),
            })
            .collect()
    };
    let (possible, online) = (cpus("possible"), cpus("online"));
    for (dev_fuse_only, cache) in
        [(false, KernelCache::WriteThrough), (false, KernelCache::Off), (true, KernelCache::WriteThrough)]
    {
        let dev = Arc::new(MemDevice::new(64 << 20));
        pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
        let fs = Fs::mount(dev, Config { cache_bytes: 8 << 20, ..Default::default() }).unwrap();
        let o = MountOptions { dev_fuse_only, threads: Some(3), kernel_cache: cache, ..Default::default() };
        // On while the mount lives (as `pwfs bench fuse` keeps it); other mounts of this
        // test binary may take the ring meanwhile, which is what every mount does where
        // the parameter is on.
        let Ok(param) = pwfs_fuse::EnableUring::on() else {
            eprintln!("skipping: this kernel has no FUSE over io_uring");
            return;
        };
        let (dir, mounted) = mount_in(&fs, &format!("uring-{dev_fuse_only}-{cache:?}"), &o);
        let want: usize = if dev_fuse_only {
            0
        } else {
            (0..possible.len()).map(|q| if online.contains(&q) { 3usize.div_ceil(online.len()) } else { 1 }).sum()
        };
        let start = std::time::Instant::now();
        while mounted.ring_entries() != want && start.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(mounted.ring_entries(), want, "dev_fuse_only {dev_fuse_only}");

        // The calls run on a thread of their own, so that a ring that never serves (a
        // request waiting for a queue with no entry) fails the test instead of hanging it.
        let (done, finished) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            let big: Vec<u8> = (0..(1usize << 20) + 1).map(|i| (i * 7 % 251) as u8).collect();
            let threads: Vec<_> = (0..4)
                .map(|t| {
                    let dir = d.clone();
                    let big = big.clone();
                    std::thread::spawn(move || {
                        // Writes of 1 MiB + 1 (the largest request and a byte), read back
                        // through the kernel's cache and directly: replies of 1 MiB, of an
                        // odd size, and past the end.
                        let p = dir.join(format!("f{t}"));
                        std::fs::write(&p, &big).unwrap();
                        assert_eq!(std::fs::read(&p).unwrap(), big);
                        use std::os::unix::fs::{FileExt, OpenOptionsExt};
                        let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&p).unwrap();
                        let mut buf = vec![0u8; (2 << 20) + 4096];
                        let at = buf.as_ptr().align_offset(4096);
                        let aligned = &mut buf[at..at + (1 << 20) + 4096];
                        assert_eq!(f.read_at(aligned, 0).unwrap(), (1 << 20) + 1);
                        assert_eq!(&aligned[..(1 << 20) + 1], &big[..]);
                        assert_eq!(f.read_at(&mut aligned[..8192], 4096).unwrap(), 8192);
                        assert_eq!(&aligned[..8192], &big[4096..4096 + 8192]);
                        assert_eq!(f.read_at(&mut aligned[..4096], 2 << 20).unwrap(), 0);
                        f.sync_all().unwrap();
                        for i in 0..200 {
                            let n = dir.join(format!("t{t}-{i}-{}", "n".repeat(i % 200)));
                            std::fs::write(&n, format!("{i}")).unwrap();
                            assert_eq!(std::fs::read_to_string(&n).unwrap(), format!("{i}"));
                            std::fs::rename(&n, dir.join(format!("r{t}-{i}"))).unwrap();
                        }
                    })
                })
                .collect();
            let ok = threads.into_iter().all(|t| t.join().is_ok());
            let _ = done.send(ok);
        });
        let ok = finished.recv_timeout(std::time::Duration::from_secs(120));
        assert_eq!(ok, Ok(true), "the calls on the mount failed or hung (dev_fuse_only {dev_fuse_only}, {cache:?})");
        let names = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(names, 4 + 4 * 200);
        assert_eq!(errno(std::fs::read(dir.join("missing"))), libc::ENOENT);
        assert_eq!(errno(std::fs::create_dir(dir.join("f0"))), libc::EEXIST);
        std::fs::remove_file(dir.join("f1")).unwrap();
        let big: Vec<u8> = (0..(1usize << 20) + 1).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(fs.read_file("/f0").unwrap(), big, "the engine has what the kernel wrote");
        mounted.unmount().unwrap();
        drop(param);
        fs.unmount().unwrap();
        let _ = std::fs::remove_dir(&dir);
    }
}
