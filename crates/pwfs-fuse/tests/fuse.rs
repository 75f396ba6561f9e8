//! The FUSE front end, driven through the kernel by ordinary system calls.
//! Needs root and /dev/fuse (CI has both); elsewhere it says so and does nothing.

mod common;
use common::{can_mount, errno, mount_in};
use pwfs::device::mem::MemDevice;
use pwfs::{Config, Fs, MkfsOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;

/// Mount `fs` through the kernel, default options, on a fresh directory named after `name`.
fn mount_on(fs: &Fs, name: &str) -> (std::path::PathBuf, pwfs_fuse::Mounted) {
    mount_in(fs, name, &Default::default())
}

/// The mount's backing device info: readahead raised in the cached modes, and in
/// write-back mode the dirty-page limits FUSE sets for untrusted servers lifted.
#[test]
fn the_kernel_tuning_of_each_cache_mode() {
    use pwfs_fuse::{KernelCache, MountOptions};
    if !can_mount() {
        return;
    }
    for cache in [KernelCache::Off, KernelCache::WriteThrough, KernelCache::WriteBack] {
        let dev = Arc::new(MemDevice::new(32 << 20));
        pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
        let fs = Fs::mount(dev, Config { cache_bytes: 4 << 20, ..Default::default() }).unwrap();
        let o = MountOptions { kernel_cache: cache, ..Default::default() };
        let (dir, mounted) = mount_in(&fs, &format!("bdi-{cache:?}"), &o);
        let d = std::fs::metadata(&dir).unwrap().dev();
        let knob = |k: &str| {
            let p = format!("/sys/class/bdi/{}:{}/{k}", libc::major(d), libc::minor(d));
            std::fs::read_to_string(&p).ok().map(|v| v.trim().to_string())
        };
        let wb = cache == KernelCache::WriteBack;
        let max_ratio = if wb { pwfs_fuse::WRITEBACK_MAX_RATIO.to_string() } else { "1".to_string() };
        assert_eq!(knob("max_ratio").as_deref(), Some(max_ratio.as_str()), "{cache:?}");
        match knob("strict_limit") {
            Some(v) => assert_eq!(v, if wb { "0" } else { "1" }, "{cache:?}"),
            None => eprintln!("this kernel has no strict_limit knob (6.2+)"),
        }
        if cache != KernelCache::Off {
            assert_eq!(knob("read_ahead_kb").as_deref(), Some("1024"), "{cache:?}");
        }
        mounted.unmount().unwrap();
        fs.unmount().unwrap();
        let _ = std::fs::remove_dir(&dir);
    }
}

#[test]
fn posix_calls_through_the_kernel() {
    if !can_mount() {
        return;
    }
    let dev = Arc::new(MemDevice::new(128 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), Config { cache_bytes: 8 << 20, ..Default::default() }).unwrap();
    let (dir, mounted) = mount_on(&fs, "posix");
    let p = |s: &str| dir.join(s);

    // Files: create, write, read back, append, truncate, sparse.
    std::fs::write(p("a"), b"hello").unwrap();
    assert_eq!(std::fs::read(p("a")).unwrap(), b"hello");
    let mut f = std::fs::OpenOptions::new().append(true).open(p("a")).unwrap();
    f.write_all(b" world").unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(std::fs::read_to_string(p("a")).unwrap(), "hello world");
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(p("a")).unwrap();
    f.seek(SeekFrom::Start(100_000)).unwrap();
    f.write_all(b"end").unwrap();
    let mut all = Vec::new();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_to_end(&mut all).unwrap();
    assert_eq!(all.len(), 100_003);
    assert!(all[11..100_000].iter().all(|b| *b == 0));
    f.set_len(5).unwrap();
    drop(f);
    assert_eq!(std::fs::read(p("a")).unwrap(), b"hello");
    let big: Vec<u8> = (0..3_000_000).map(|i| (i % 251) as u8).collect();
    std::fs::write(p("big"), &big).unwrap();
    assert_eq!(std::fs::read(p("big")).unwrap(), big);

    // Names, with the engine's errno arriving unchanged.
    std::fs::create_dir(p("d")).unwrap();
    assert_eq!(errno(std::fs::create_dir(p("d"))), libc::EEXIST);
    std::fs::write(p("d/x"), b"x").unwrap();
    assert_eq!(errno(std::fs::remove_dir(p("d"))), libc::ENOTEMPTY);
    assert_eq!(errno(std::fs::read(p("nope"))), libc::ENOENT);
    assert_eq!(errno(std::fs::remove_file(p("d"))), libc::EISDIR);
    assert_eq!(errno(std::fs::rename(p("d"), p("d/x/y"))), libc::ENOTDIR);
    assert_eq!(errno(std::fs::write(p(&"n".repeat(256)), b"")), libc::ENAMETOOLONG);
    std::fs::rename(p("d/x"), p("y")).unwrap();
    std::fs::hard_link(p("y"), p("z")).unwrap();
    assert_eq!(std::fs::metadata(p("z")).unwrap().nlink(), 2);
    std::os::unix::fs::symlink("y", p("s")).unwrap();
    assert_eq!(std::fs::read_link(p("s")).unwrap(), std::path::Path::new("y"));
    assert_eq!(std::fs::read(p("s")).unwrap(), b"x");
    std::fs::set_permissions(p("y"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(std::fs::metadata(p("z")).unwrap().mode() & 0o777, 0o600);
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["a", "big", "d", "s", "y", "z"]);
    std::fs::remove_dir(p("d")).unwrap();

    // mmap works on direct-I/O files (FUSE_DIRECT_IO_ALLOW_MMAP).
    let f = std::fs::File::open(p("big")).unwrap();
    // SAFETY: a read-only shared mapping of an open file, unmapped below.
    unsafe {
        use std::os::unix::io::AsRawFd;
        let m = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 4096);
        assert_ne!(m, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        let s = std::slice::from_raw_parts(m as *const u8, 8192);
        assert_eq!(s, &big[4096..12288]);
        libc::munmap(m, 8192);
    }
    drop(f);

    // Extended attributes, stored by the engine.
    xattr_set(&p("y"), "user.color", b"blue", 0).unwrap();
    assert_eq!(xattr_get(&p("y"), "user.color").unwrap(), b"blue");
    assert_eq!(xattr_set(&p("y"), "user.color", b"red", libc::XATTR_CREATE).unwrap_err(), libc::EEXIST);
    assert_eq!(xattr_set(&p("y"), "user.none", b"x", libc::XATTR_REPLACE).unwrap_err(), libc::ENODATA);
    assert_eq!(xattr_get(&p("y"), "user.none").unwrap_err(), libc::ENODATA);
    assert_eq!(xattr_set(&p("y"), "bogus.ns", b"x", 0).unwrap_err(), libc::EOPNOTSUPP);
    xattr_set(&p("y"), "user.size", &[7u8; 1000], 0).unwrap();
    assert_eq!(xattr_list(&p("y")), vec!["user.color", "user.size"]);
    assert_eq!(xattr_remove(&p("y"), "user.color"), 0);
    assert_eq!(xattr_list(&p("z")), vec!["user.size"], "same inode through the hard link");

    let st = nix_statvfs(&dir);
    assert!(st > 0, "statfs reports free blocks");
    unmount_and_check(mounted, fs, &*dev, &dir);
}

/// O_TRUNC through the kernel: it truncates (also with O_RDONLY, as on Linux), and it
/// never touches a running binary. With FUSE_ATOMIC_O_TRUNC the kernel handed O_TRUNC to
/// the server before its ETXTBSY check and emptied its own view of the file, which killed
/// the running program (pjdfstest open::etxtbsy caught it about once in 40 runs).
#[test]
fn o_trunc_truncates_but_not_a_running_binary() {
    if !can_mount() {
        return;
    }
    let dev = Arc::new(MemDevice::new(64 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), Config { cache_bytes: 8 << 20, ..Default::default() }).unwrap();
    let (dir, mounted) = mount_on(&fs, "trunc");
    let p = |s: &str| dir.join(s);
    let open = |path: &std::path::Path, flags: i32| {
        // SAFETY: plain syscalls on a NUL-terminated path.
        let fd = unsafe { libc::open(cpath(path).as_ptr(), flags) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
        }
        unsafe { libc::close(fd) };
        Ok(())
    };

    for flags in [libc::O_WRONLY | libc::O_TRUNC, libc::O_RDONLY | libc::O_TRUNC] {
        std::fs::write(p("f"), b"some bytes").unwrap();
        let before = std::fs::metadata(p("f")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        open(&p("f"), flags).unwrap();
        let after = std::fs::metadata(p("f")).unwrap();
        assert_eq!(after.len(), 0, "flags {flags:o}");
        assert!(after.modified().unwrap() > before.modified().unwrap(), "O_TRUNC sets mtime");
        assert!(after.ctime_nsec() != before.ctime_nsec() || after.ctime() != before.ctime(), "and ctime");
        assert_eq!(std::fs::read(p("f")).unwrap(), b"");
    }

    // ftruncate to the same size, and O_TRUNC of an empty file, set the times (as on
    // ext4, and as POSIX asks of O_TRUNC).
    std::fs::write(p("same"), b"four").unwrap();
    let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
    let set_old = || std::fs::File::options().write(true).open(p("same")).unwrap().set_modified(old).unwrap();
    set_old();
    std::fs::File::options().write(true).open(p("same")).unwrap().set_len(4).unwrap();
    assert!(std::fs::metadata(p("same")).unwrap().modified().unwrap() > old, "ftruncate to the same size");
    std::fs::File::options().write(true).open(p("same")).unwrap().set_len(0).unwrap();
    set_old();
    open(&p("same"), libc::O_WRONLY | libc::O_TRUNC).unwrap();
    assert!(std::fs::metadata(p("same")).unwrap().modified().unwrap() > old, "O_TRUNC of an empty file");

    let sleep = std::fs::read("/bin/sleep").unwrap();
    std::fs::write(p("sleep"), &sleep).unwrap();
    std::fs::set_permissions(p("sleep"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut child = std::process::Command::new(p("sleep")).arg("1").spawn().unwrap();
    for flags in [libc::O_WRONLY, libc::O_RDWR, libc::O_RDONLY | libc::O_TRUNC] {
        assert_eq!(open(&p("sleep"), flags), Err(libc::ETXTBSY), "flags {flags:o}");
    }
    assert_eq!(std::fs::metadata(p("sleep")).unwrap().len(), sleep.len() as u64);
    // The program wakes, runs its code from the mapped file and exits normally.
    assert!(child.wait().unwrap().success(), "the running binary was damaged");
    assert_eq!(std::fs::read(p("sleep")).unwrap(), sleep);

    unmount_and_check(mounted, fs, &*dev, &dir);
}

/// A non-blocking write whose page then cannot be read is reported once: by close(2)
/// through the kernel (FUSE flush) with direct I/O; in the cached modes, which answer
/// the first flush ENOSYS so that no close costs a request, by the next fsync, as ext4
/// reports a write-back error.
#[test]
fn a_lost_write_is_reported_once() {
    use pwfs::device::sim::{SimConfig, SimDevice};
    use pwfs_fuse::{KernelCache, MountOptions};
    if !can_mount() {
        return;
    }
    for cache in [KernelCache::Off, KernelCache::WriteThrough] {
        let mem = MemDevice::new(64 << 20);
        pwfs::mkfs(&mem, &MkfsOptions::default()).unwrap();
        let dev = Arc::new(SimDevice::new(mem.snapshot(), SimConfig::default()));
        let config = Config { cache_bytes: 8 << 20, fetch: pwfs::FetchPolicy::Lazy, ..Default::default() };
        let fs = Fs::mount(dev.clone(), config).unwrap();
        fs.write_file("/f", &[7u8; 64 * 1024]).unwrap();
        fs.evict_cache().unwrap();
        let o = MountOptions { kernel_cache: cache, ..Default::default() };
        let (dir, mounted) = mount_in(&fs, &format!("lost-{cache:?}"), &o);
        let path = cpath(&dir.join("f"));
        let last_errno = || std::io::Error::last_os_error().raw_os_error();
        // SAFETY: plain syscalls on a NUL-terminated path and a local buffer.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_RDWR);
            assert!(fd >= 0);
            assert_eq!(libc::pwrite(fd, b"lost".as_ptr().cast(), 4, 20_000), 4, "returns without reading the page");
            dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
            let mut buf = [0u8; 8];
            assert_eq!(libc::pread(fd, buf.as_mut_ptr().cast(), 8, 19_998), -1);
            assert_eq!(last_errno(), Some(libc::EIO));
            dev.set_config(SimConfig::default());
            if cache == KernelCache::Off {
                let reader = libc::open(path.as_ptr(), libc::O_RDONLY);
                assert!(reader >= 0);
                assert_eq!(libc::close(reader), 0, "a reader's close leaves the report to the writer");
                assert_eq!(libc::close(fd), -1, "close reports the lost write");
                assert_eq!(last_errno(), Some(libc::EIO));
                let fd = libc::open(path.as_ptr(), libc::O_RDWR);
                assert!(fd >= 0);
                assert_eq!(libc::fsync(fd), 0, "once");
                assert_eq!(libc::close(fd), 0, "once");
            } else {
                // A close reports nothing (the first is answered ENOSYS and the
                // kernel sends no more); the loss waits for the fsync.
                let other = libc::open(path.as_ptr(), libc::O_RDWR);
                assert!(other >= 0);
                assert_eq!(libc::close(other), 0);
                assert_eq!(libc::fsync(fd), -1, "fsync reports the lost write");
                assert_eq!(last_errno(), Some(libc::EIO));
                assert_eq!(libc::fsync(fd), 0, "once");
                assert_eq!(libc::close(fd), 0);
            }
        }
        unmount_and_check(mounted, fs, &*dev, &dir);
    }
}

/// Unmount the kernel's view, then the engine; the image must pass fsck.
fn unmount_and_check(mounted: pwfs_fuse::Mounted, fs: Fs, dev: &dyn pwfs::device::Device, dir: &std::path::Path) {
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
    let r = pwfs::fsck::check(dev).unwrap();
    assert!(r.is_clean(), "{:?}", r.errors);
    std::fs::remove_dir_all(dir).unwrap();
}

fn nix_statvfs(path: &std::path::Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: statvfs into a zeroed struct.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0);
        st.f_bavail
    }
}

fn cpath(p: &std::path::Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn xattr_set(p: &std::path::Path, name: &str, value: &[u8], flags: i32) -> Result<(), i32> {
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C strings and a value buffer of the given length.
    let r = unsafe { libc::setxattr(cpath(p).as_ptr(), n.as_ptr(), value.as_ptr() as *const _, value.len(), flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

fn xattr_get(p: &std::path::Path, name: &str) -> Result<Vec<u8>, i32> {
    let n = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 65536];
    // SAFETY: valid C strings and a buffer of the given length.
    let r = unsafe { libc::getxattr(cpath(p).as_ptr(), n.as_ptr(), buf.as_mut_ptr() as *mut _, buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

fn xattr_list(p: &std::path::Path) -> Vec<String> {
    let mut buf = vec![0u8; 65536];
    // SAFETY: a valid C string and a buffer of the given length.
    let r = unsafe { libc::listxattr(cpath(p).as_ptr(), buf.as_mut_ptr() as *mut _, buf.len()) };
    assert!(r >= 0, "listxattr: {}", std::io::Error::last_os_error());
    buf.truncate(r as usize);
    let mut names: Vec<String> =
        buf.split(|b| *b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8(s.to_vec()).unwrap()).collect();
    names.sort();
    names
}

fn xattr_remove(p: &std::path::Path, name: &str) -> i32 {
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C strings.
    unsafe { libc::removexattr(cpath(p).as_ptr(), n.as_ptr()) }
}
