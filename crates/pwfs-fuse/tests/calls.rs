//! The calls databases, package managers and test suites use beyond read and write,
//! through the kernel in every kernel cache mode: fallocate, SEEK_DATA/SEEK_HOLE,
//! renameat2 (exchange, whiteout), file handles.

mod common;
use common::{can_mount, mount_in};
use pwfs::device::mem::MemDevice;
use pwfs::{Config, Fs, MkfsOptions};
use pwfs_fuse::{KernelCache, MountOptions};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::sync::Arc;

const MODES: [KernelCache; 3] = [KernelCache::WriteThrough, KernelCache::Off, KernelCache::WriteBack];

fn fresh(name: &str, cache: KernelCache) -> (Arc<MemDevice>, Fs, std::path::PathBuf, pwfs_fuse::Mounted) {
    let dev = Arc::new(MemDevice::new(128 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let fs = Fs::mount(dev.clone(), Config { cache_bytes: 8 << 20, ..Default::default() }).unwrap();
    let (dir, mounted) =
        mount_in(&fs, &format!("{name}-{cache:?}"), &MountOptions { kernel_cache: cache, ..Default::default() });
    (dev, fs, dir, mounted)
}

/// Unmount the kernel's view and the engine; the image must pass fsck (`what` names the
/// case in a failure).
fn finish(mounted: pwfs_fuse::Mounted, fs: Fs, dev: &dyn pwfs::device::Device, dir: &std::path::Path, what: &str) {
    mounted.unmount().unwrap();
    std::fs::remove_dir(dir).unwrap();
    fs.unmount().unwrap();
    let r = pwfs::fsck::check(dev).unwrap();
    assert!(r.is_clean(), "{what}: {}", r.errors.join("\n"));
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

fn fallocate(f: &std::fs::File, mode: i32, off: i64, len: i64) -> Result<(), i32> {
    match unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) } {
        0 => Ok(()),
        _ => Err(last_errno()),
    }
}

fn seek(f: &std::fs::File, off: i64, whence: i32) -> Result<i64, i32> {
    match unsafe { libc::lseek(f.as_raw_fd(), off, whence) } {
        -1 => Err(last_errno()),
        n => Ok(n),
    }
}

fn pread(f: &std::fs::File, len: usize, off: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, off).unwrap();
    buf
}

#[test]
fn fallocate_and_seek_hole_data_through_the_kernel() {
    if !can_mount() {
        return;
    }
    for cache in MODES {
        let (dev, fs, dir, mounted) = fresh("falloc", cache);
        let path = dir.join("f");
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[1u8; 16384], 0).unwrap();
        // Preallocate past the end: size grows, the new part reads as zeros.
        fallocate(&f, 0, 16384, 1 << 20).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 16384 + (1 << 20), "{cache:?}");
        // (The kernel keeps st_blocks with the attributes it caches; the engine's count.)
        let ino = f.metadata().unwrap().ino();
        let blocks = fs.getattr(ino).unwrap().blocks;
        assert!(blocks >= (1 << 20) / 512, "{cache:?}: {blocks} sectors");
        assert!(pread(&f, 1 << 20, 16384).iter().all(|b| *b == 0));
        // KEEP_SIZE past the end: blocks, no size.
        fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 2 << 20, 1 << 20).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 16384 + (1 << 20));
        // Punch inside the written part (partial blocks zeroed too).
        fallocate(&f, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 1000, 8192).unwrap();
        let head = pread(&f, 16384, 0);
        assert!(head[..1000].iter().all(|b| *b == 1), "{cache:?}");
        assert!(head[1000..9192].iter().all(|b| *b == 0), "{cache:?}: punched bytes read back");
        assert!(head[9192..].iter().all(|b| *b == 1), "{cache:?}");
        // Zero range over the rest of the written part.
        fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 9192, 100).unwrap();
        assert!(pread(&f, 100, 9192).iter().all(|b| *b == 0), "{cache:?}");
        assert_eq!(pread(&f, 1, 9292), [1]);
        // SEEK_DATA/SEEK_HOLE without the kernel's cache: data at 0, a hole at block 1
        // (punched whole), data at block 2, and the preallocated rest is a hole. With
        // it, the kernel answers from the size (its dirty pages are not the engine's to
        // see): all data, the one hole at the end.
        let size: i64 = 16384 + (1 << 20);
        if cache == KernelCache::Off {
            assert_eq!(seek(&f, 0, libc::SEEK_DATA), Ok(0));
            assert_eq!(seek(&f, 0, libc::SEEK_HOLE), Ok(4096), "{cache:?}");
            assert_eq!(seek(&f, 4096, libc::SEEK_DATA), Ok(8192), "{cache:?}");
            assert_eq!(seek(&f, 8192, libc::SEEK_HOLE), Ok(16384), "{cache:?}");
            assert_eq!(seek(&f, 16384, libc::SEEK_DATA), Err(libc::ENXIO), "{cache:?}");
        } else {
            assert_eq!(seek(&f, 0, libc::SEEK_DATA), Ok(0));
            assert_eq!(seek(&f, 0, libc::SEEK_HOLE), Ok(size), "{cache:?}");
            assert_eq!(seek(&f, 4096, libc::SEEK_DATA), Ok(4096), "{cache:?}");
        }
        assert_eq!(seek(&f, 1 << 30, libc::SEEK_HOLE), Err(libc::ENXIO));
        // The kernel keeps collapse and insert range from FUSE.
        assert_eq!(fallocate(&f, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096), Err(libc::EOPNOTSUPP));
        f.sync_all().unwrap();
        drop(f);
        finish(mounted, fs, &*dev, &dir, &format!("{cache:?}"));
    }
}

/// `posix_fallocate` (glibc's, over fallocate(2)) reserves space so that writes into it
/// never fail with ENOSPC.
#[test]
fn posix_fallocate_reserves_space() {
    if !can_mount() {
        return;
    }
    let (_dev, fs, dir, mounted) = fresh("posixfalloc", KernelCache::WriteThrough);
    let path = CString::new(dir.join("r").as_os_str().as_bytes()).unwrap();
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o644) };
    assert!(fd >= 0);
    assert_eq!(unsafe { libc::posix_fallocate(fd, 0, 8 << 20) }, 0);
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    assert_eq!(st.st_size, 8 << 20);
    assert_eq!(unsafe { libc::posix_fallocate(fd, 0, 1 << 40) }, libc::ENOSPC);
    unsafe { libc::close(fd) };
    mounted.unmount().unwrap();
    std::fs::remove_dir(&dir).unwrap();
    fs.unmount().unwrap();
}

fn renameat2(from: &std::path::Path, to: &std::path::Path, flags: u32) -> Result<(), i32> {
    let (a, b) = (CString::new(from.as_os_str().as_bytes()).unwrap(), CString::new(to.as_os_str().as_bytes()).unwrap());
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

#[test]
fn renameat2_exchange_and_whiteout_through_the_kernel() {
    if !can_mount() {
        return;
    }
    for cache in MODES {
        let (dev, fs, dir, mounted) = fresh("rename2", cache);
        let p = |s: &str| dir.join(s);
        std::fs::write(p("a"), b"aaa").unwrap();
        std::fs::create_dir(p("d")).unwrap();
        std::fs::write(p("d/b"), b"bbb").unwrap();
        renameat2(&p("a"), &p("d/b"), libc::RENAME_EXCHANGE).unwrap();
        assert_eq!(std::fs::read(p("a")).unwrap(), b"bbb", "{cache:?}");
        assert_eq!(std::fs::read(p("d/b")).unwrap(), b"aaa", "{cache:?}");
        assert_eq!(renameat2(&p("a"), &p("nope"), libc::RENAME_EXCHANGE), Err(libc::ENOENT));
        // A directory and a file swap; the directory's '..' follows it.
        renameat2(&p("d"), &p("a"), libc::RENAME_EXCHANGE).unwrap();
        assert!(std::fs::metadata(p("a")).unwrap().is_dir());
        assert_eq!(std::fs::read(p("a/b")).unwrap(), b"aaa");
        assert_eq!(std::fs::read(p("d")).unwrap(), b"bbb");
        // Whiteout: the source name becomes a character device 0:0.
        renameat2(&p("d"), &p("e"), libc::RENAME_WHITEOUT).unwrap();
        let w = std::fs::symlink_metadata(p("d")).unwrap();
        assert_eq!(w.mode() & libc::S_IFMT, libc::S_IFCHR, "{cache:?}");
        assert_eq!(w.rdev(), 0);
        assert_eq!(std::fs::read(p("e")).unwrap(), b"bbb");
        finish(mounted, fs, &*dev, &dir, &format!("{cache:?}"));
    }
}

#[repr(C)]
struct FileHandle {
    bytes: u32,
    kind: i32,
    data: [u8; 128],
}

fn name_to_handle(path: &std::path::Path) -> Result<FileHandle, i32> {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut h = FileHandle { bytes: 128, kind: 0, data: [0; 128] };
    let mut mount_id: i32 = 0;
    let r = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c.as_ptr(),
            &mut h as *mut FileHandle,
            &mut mount_id,
            0,
        )
    };
    if r == 0 {
        Ok(h)
    } else {
        Err(last_errno())
    }
}

fn open_by_handle(mount: &std::path::Path, h: &FileHandle) -> Result<std::fs::File, i32> {
    use std::os::unix::io::FromRawFd;
    let m = std::fs::File::open(mount).unwrap();
    let fd =
        unsafe { libc::syscall(libc::SYS_open_by_handle_at, m.as_raw_fd(), h as *const FileHandle, libc::O_RDONLY) };
    if fd < 0 {
        Err(last_errno())
    } else {
        Ok(unsafe { std::fs::File::from_raw_fd(fd as i32) })
    }
}

/// A file handle opens its file again after the kernel forgot the inode and after a
/// remount; a handle of a deleted file is stale.
#[test]
fn file_handles_survive_a_remount() {
    if !can_mount() {
        return;
    }
    let dev = Arc::new(MemDevice::new(64 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let config = || Config { cache_bytes: 8 << 20, ..Default::default() };
    let fs = Fs::mount(dev.clone(), config()).unwrap();
    let (dir, mounted) = mount_in(&fs, "handles", &Default::default());
    std::fs::create_dir(dir.join("d")).unwrap();
    std::fs::write(dir.join("d/kept"), b"kept contents").unwrap();
    std::fs::write(dir.join("gone"), b"x").unwrap();
    let kept = name_to_handle(&dir.join("d/kept")).unwrap();
    let gone = name_to_handle(&dir.join("gone")).unwrap();
    let d = name_to_handle(&dir.join("d")).unwrap();
    std::fs::remove_file(dir.join("gone")).unwrap();
    // Before a commit frees it: once the kernel lets go of the inode, a handle of it is
    // stale (the engine reopened the deleted file before). The kernel lets go when the
    // close's RELEASE has been answered, which it does not wait for (it holds the inode
    // till then; over FUSE's io_uring the answer can come after the unlink): while it
    // still holds the inode it opens the handle itself, as ext4 does with an inode in
    // memory.
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let stale = loop {
        match open_by_handle(&dir, &gone) {
            Ok(f) if std::time::Instant::now() < give_up => {
                drop(f);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => break r.err(),
        }
    };
    assert_eq!(stale, Some(libc::ESTALE), "a file just deleted");
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
    // A new daemon, a new mount: the kernel knows none of these inodes.
    let fs = Fs::mount(dev.clone(), config()).unwrap();
    let mounted = pwfs_fuse::mount_with(fs.clone(), &dir, &Default::default()).unwrap();
    let mut f = open_by_handle(&dir, &kept).expect("the handle opens after a remount");
    let mut s = String::new();
    use std::io::Read;
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "kept contents");
    assert!(open_by_handle(&dir, &d).is_ok(), "a directory's handle");
    assert_eq!(open_by_handle(&dir, &gone).err(), Some(libc::ESTALE), "a deleted file's handle is stale");
    // Its number taken by a new file: the generation tells them apart.
    for i in 0..4 {
        std::fs::write(dir.join(format!("new{i}")), b"n").unwrap();
    }
    assert_eq!(open_by_handle(&dir, &gone).err(), Some(libc::ESTALE), "a reused inode number is stale");
    drop(f);
    mounted.unmount().unwrap();
    std::fs::remove_dir(&dir).unwrap();
    fs.unmount().unwrap();
}

/// chattr +i / +a through the kernel: kept by the engine, shown by lsattr, enforced.
#[test]
fn chattr_immutable_and_append_only_through_the_kernel() {
    if !can_mount() {
        return;
    }
    if std::process::Command::new("chattr").arg("--help").output().is_err() {
        eprintln!("skipping: chattr (e2fsprogs) is not installed");
        return;
    }
    for cache in MODES {
        let (dev, fs, dir, mounted) = fresh("chattr", cache);
        let p = |s: &str| dir.join(s);
        std::fs::write(p("i"), b"fixed").unwrap();
        std::fs::write(p("a"), b"log:").unwrap();
        let run = |args: &[&str]| {
            let o = std::process::Command::new(args[0]).args(&args[1..]).output().unwrap();
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
            String::from_utf8_lossy(&o.stdout).to_string()
        };
        let before = std::fs::metadata(p("i")).unwrap();
        run(&["chattr", "+i", p("i").to_str().unwrap()]);
        run(&["chattr", "+a", p("a").to_str().unwrap()]);
        // The flags changed the ctime, and the kernel's cached attributes show it (in
        // write-back mode the kernel keeps a regular file's times itself and takes
        // none from the server).
        let after = std::fs::metadata(p("i")).unwrap();
        if cache != KernelCache::WriteBack {
            assert_ne!((after.ctime(), after.ctime_nsec()), (before.ctime(), before.ctime_nsec()), "{cache:?}");
        }
        let l = run(&["lsattr", p("i").to_str().unwrap()]);
        assert!(l.split_whitespace().next().unwrap().contains('i'), "{cache:?}: lsattr shows {l}");
        let e = |r: std::io::Result<()>| r.err().and_then(|e| e.raw_os_error());
        assert_eq!(e(std::fs::write(p("i"), b"x")), Some(libc::EPERM), "{cache:?}");
        assert_eq!(e(std::fs::remove_file(p("i"))), Some(libc::EPERM));
        assert_eq!(e(std::fs::rename(p("i"), p("j"))), Some(libc::EPERM));
        // A write that is not an append: refused at open where the mount sees opens
        // (direct I/O, write-back), at the write in write-through mode (no open requests).
        let rewrite = std::fs::OpenOptions::new().write(true).open(p("a")).and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.write_at(b"X", 0).map(drop)
        });
        assert_eq!(e(rewrite), Some(libc::EPERM), "{cache:?}");
        // Also at the end of the file: without O_APPEND, ext4 refuses the open itself.
        let at_end = std::fs::OpenOptions::new().write(true).open(p("a")).and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.write_at(b"X", 4).map(drop)
        });
        assert_eq!(e(at_end), Some(libc::EPERM), "{cache:?}");
        // And copy_file_range into it (an O_APPEND destination the kernel refuses itself).
        std::fs::write(p("src"), b"copied").unwrap();
        let copy = std::fs::File::open(p("src")).and_then(|from| {
            let to = std::fs::OpenOptions::new().write(true).open(p("a"))?;
            let mut off_out: i64 = 4;
            // SAFETY: both descriptors are open; the offsets are locals.
            let r = unsafe {
                libc::copy_file_range(from.as_raw_fd(), std::ptr::null_mut(), to.as_raw_fd(), &mut off_out, 6, 0)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
        assert_eq!(e(copy), Some(libc::EPERM), "{cache:?}");
        // Times: set to now both at once (touch) passes; any other setting is an
        // explicit change of times, refused (notify_change's ATTR_TIMES_SET).
        let c = CString::new(p("a").as_os_str().as_bytes()).unwrap();
        let now_omit = [
            libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
            libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
        ];
        // SAFETY: a NUL-terminated path and two timespecs.
        let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), now_omit.as_ptr(), 0) };
        assert_eq!((r, last_errno()), (-1, libc::EPERM), "{cache:?}: utimensat NOW, OMIT");
        // SAFETY: as above; a null array is "both now".
        let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), std::ptr::null(), 0) };
        assert_eq!(r, 0, "{cache:?}: touch: {}", std::io::Error::last_os_error());
        std::fs::remove_file(p("src")).unwrap();
        assert_eq!(std::fs::read(p("a")).unwrap(), b"log:", "{cache:?}");
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(p("a")).unwrap();
        f.write_all(b"more").unwrap();
        drop(f);
        assert_eq!(std::fs::read(p("a")).unwrap(), b"log:more");
        // The engine has it too (in write-back mode an append-only file is written through).
        assert_eq!(fs.read_file("/a").unwrap(), b"log:more", "{cache:?}");
        // FS_IOC_GETVERSION: the generation file handles carry (an int, as ext4's).
        let f = std::fs::File::open(p("a")).unwrap();
        let mut version: u64 = u64::MAX;
        let r = unsafe { libc::ioctl(f.as_raw_fd(), 0x8008_7601, &mut version) };
        assert_eq!(r, 0, "{cache:?}: FS_IOC_GETVERSION: {}", std::io::Error::last_os_error());
        let generation = fs.metadata("/a").unwrap().generation;
        assert_eq!(version as u32, generation, "{cache:?}");
        assert_eq!(version >> 32, u64::from(u32::MAX), "{cache:?}: four bytes written, as ext4");
        drop(f);
        // The 32-bit encoding of FS_IOC_SETFLAGS is not one the kernel checks for a 64-bit
        // caller: the mount does not take it (a user could set flags unchecked).
        let f = std::fs::File::open(p("a")).unwrap();
        let zero: u32 = 0;
        let r = unsafe { libc::ioctl(f.as_raw_fd(), 0x4004_6602, &zero) };
        assert_eq!((r, last_errno()), (-1, libc::ENOTTY), "{cache:?}");
        drop(f);
        run(&["chattr", "-i", p("i").to_str().unwrap()]);
        run(&["chattr", "-a", p("a").to_str().unwrap()]);
        std::fs::remove_file(p("i")).unwrap();
        std::fs::write(p("a"), b"").unwrap();
        finish(mounted, fs, &*dev, &dir, &format!("{cache:?}"));
    }
}

#[test]
fn extended_attributes_of_64_kib_through_the_kernel() {
    if !can_mount() {
        return;
    }
    let (dev, fs, dir, mounted) = fresh("xattr64k", KernelCache::WriteThrough);
    let path = dir.join("f");
    std::fs::write(&path, b"").unwrap();
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let value: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
    for name in ["user.one", "user.two"] {
        let n = CString::new(name).unwrap();
        let r = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        assert_eq!(r, 0, "setxattr {name}: {}", std::io::Error::last_os_error());
    }
    let n = CString::new("user.two").unwrap();
    let mut back = vec![0u8; 65536];
    let got = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), back.as_mut_ptr().cast(), back.len()) };
    assert_eq!(got, 65536);
    assert_eq!(back, value);
    finish(mounted, fs, &*dev, &dir, "");
}

/// open(O_TMPFILE) and linkat: a nameless file, named later; an O_EXCL one never.
#[test]
fn o_tmpfile_and_linkat_through_the_kernel() {
    if !can_mount() {
        return;
    }
    for cache in MODES {
        let (dev, fs, dir, mounted) = fresh("tmpfile", cache);
        let d = CString::new(dir.as_os_str().as_bytes()).unwrap();
        let fd = unsafe { libc::open(d.as_ptr(), libc::O_TMPFILE | libc::O_RDWR, 0o640) };
        assert!(fd >= 0, "{cache:?}: open(O_TMPFILE): {}", std::io::Error::last_os_error());
        let data = b"written before it had a name";
        assert_eq!(unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) }, data.len() as isize);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{cache:?}: no name yet");
        let name = CString::new(dir.join("named").as_os_str().as_bytes()).unwrap();
        let empty = CString::new("").unwrap();
        let r = unsafe { libc::linkat(fd, empty.as_ptr(), libc::AT_FDCWD, name.as_ptr(), libc::AT_EMPTY_PATH) };
        assert_eq!(r, 0, "{cache:?}: linkat: {}", std::io::Error::last_os_error());
        unsafe { libc::close(fd) };
        assert_eq!(std::fs::read(dir.join("named")).unwrap(), data);
        // O_EXCL: linkat refuses it (the kernel checks I_LINKABLE itself, or we do).
        let fd = unsafe { libc::open(d.as_ptr(), libc::O_TMPFILE | libc::O_RDWR | libc::O_EXCL, 0o600) };
        assert!(fd >= 0);
        let other = CString::new(dir.join("other").as_os_str().as_bytes()).unwrap();
        let r = unsafe { libc::linkat(fd, empty.as_ptr(), libc::AT_FDCWD, other.as_ptr(), libc::AT_EMPTY_PATH) };
        assert_eq!(r, -1, "{cache:?}: an O_EXCL tmpfile was linked");
        unsafe { libc::close(fd) };
        finish(mounted, fs, &*dev, &dir, &format!("{cache:?}"));
    }
}

/// A deleted file gives its inode and space back once the kernel lets go of it, in
/// every mode, whether it was created or opened (in write-through mode the kernel sends
/// no open or release requests once it knows the mount does without them), and stays
/// readable while a descriptor is open.
#[test]
fn deleted_files_are_freed_after_their_last_close() {
    if !can_mount() {
        return;
    }
    for cache in MODES {
        let (dev, fs, dir, mounted) = fresh("freed", cache);
        let p = |s: &str| dir.join(s);
        std::fs::write(p("first"), b"x").unwrap();
        // An open request, or the kernel learns it need not send one.
        std::fs::read(p("first")).unwrap();
        // The directory grows to hold the names once (directories do not shrink).
        for i in 0..20 {
            std::fs::write(p(&format!("f{i}")), b"").unwrap();
        }
        for i in 0..20 {
            std::fs::remove_file(p(&format!("f{i}"))).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        fs.sync().unwrap();
        let (inodes, blocks) = (fs.statfs().inodes_free, fs.statfs().blocks_free);
        for i in 0..20 {
            std::fs::write(p(&format!("f{i}")), vec![7u8; 128 << 10]).unwrap();
        }
        for i in 0..20 {
            std::fs::read(p(&format!("f{i}"))).unwrap();
        }
        let held = std::fs::File::open(p("f0")).unwrap();
        for i in 0..20 {
            std::fs::remove_file(p(&format!("f{i}"))).unwrap();
        }
        use std::io::Read;
        let mut back = Vec::new();
        (&held).read_to_end(&mut back).unwrap();
        assert_eq!(back.len(), 128 << 10, "{cache:?}: an open deleted file reads");
        drop(held);
        // The kernel forgets the inodes asynchronously.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while fs.statfs().inodes_free != inodes && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(fs.statfs().inodes_free, inodes, "{cache:?}: deleted inodes not freed");
        fs.sync().unwrap();
        assert_eq!(fs.statfs().blocks_free, blocks, "{cache:?}: deleted files' blocks not freed");
        mounted.unmount().unwrap();
        std::fs::remove_dir(&dir).unwrap();
        fs.unmount().unwrap();
        let r = pwfs::fsck::check(&*dev).unwrap();
        assert!(r.is_clean() && r.notes.is_empty(), "{cache:?}: {:?} {:?}", r.errors, r.notes);
    }
}

/// Any time a file's owner sets with utimensat, to the ends of a 64-bit second, is
/// kept and given back, and the serving thread lives on (fuser's conversion of
/// `i64::MIN` seconds panicked it, leaving the caller hung): through every mode, and
/// from the image after a remount.
#[test]
fn extreme_timestamps_are_kept_and_harm_nothing() {
    if !can_mount() {
        return;
    }
    // (At exactly the ends of its range the kernel keeps no nanoseconds.)
    let cases: [(i64, i64); 6] = [
        (i64::MIN, 0),
        (i64::MIN + 1, 1),
        (-1, 500_000_000),
        (i64::MAX - 1, 999_999_999),
        (i64::MAX, 0),
        (1_700_000_000, 7),
    ];
    for cache in MODES {
        let (dev, fs, dir, mounted) = fresh("times", cache);
        let path = dir.join("f");
        std::fs::write(&path, b"x").unwrap();
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        for (sec, nsec) in cases {
            let ts = [libc::timespec { tv_sec: sec, tv_nsec: nsec }, libc::timespec { tv_sec: sec, tv_nsec: nsec }];
            // SAFETY: a NUL-terminated path and two timespecs.
            let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), 0) };
            assert_eq!(r, 0, "{cache:?} {sec}.{nsec}: errno {}", last_errno());
            let m = std::fs::metadata(&path).unwrap();
            assert_eq!((m.mtime(), m.mtime_nsec()), (sec, nsec), "{cache:?} mtime");
            assert_eq!((m.atime(), m.atime_nsec()), (sec, nsec), "{cache:?} atime");
        }
        // The last case stays; the engine has it too.
        let m = fs.metadata("/f").unwrap();
        assert_eq!((m.mtime.sec, m.mtime.nsec), (1_700_000_000, 7));
        let ts = [libc::timespec { tv_sec: i64::MIN, tv_nsec: 0 }; 2];
        // SAFETY: as above.
        assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), 0) }, 0);
        assert_eq!(std::fs::read(&path).unwrap(), b"x", "{cache:?}: still served");
        finish(mounted, fs, &*dev, &dir, &format!("{cache:?}"));
        let fs = Fs::mount(dev.clone(), Config::default()).unwrap();
        assert_eq!(fs.metadata("/f").unwrap().mtime.sec, i64::MIN, "{cache:?}: from the image");
        fs.unmount().unwrap();
    }
}

/// A shared mapping's stores to an immutable file (write-through mode lets the file be
/// opened for writing: no open requests) are refused when the kernel writes them
/// back, and the kernel's copy of the pages is dropped: readers see the file, not the
/// refused bytes.
#[test]
fn refused_mapped_stores_do_not_stay_in_the_kernel_cache() {
    if !can_mount() {
        return;
    }
    let (dev, fs, dir, mounted) = fresh("immmap", KernelCache::WriteThrough);
    let path = dir.join("m");
    std::fs::write(&path, [b'A'; 4096]).unwrap();
    let o = std::process::Command::new("chattr").arg("+i").arg(&path).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
        // Refused at open: nothing to map (a kernel or mode that sends opens).
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EPERM)),
        Ok(f) => unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            assert_ne!(map, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
            std::ptr::write_bytes(map as *mut u8, b'B', 4096);
            let r = libc::msync(map, 4096, libc::MS_SYNC);
            assert_eq!((r, last_errno()), (-1, libc::EPERM), "the write-back of an immutable file's page");
            libc::munmap(map, 4096);
            drop(f);
        },
    }
    // The pages are dropped on another thread: wait for it (bounded).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = std::fs::read(&path).unwrap();
        if now == [b'A'; 4096] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "refused stores still read back: {:?}", &now[..8]);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(fs.read_file("/m").unwrap(), [b'A'; 4096]);
    let o = std::process::Command::new("chattr").arg("-i").arg(&path).output().unwrap();
    assert!(o.status.success());
    finish(mounted, fs, &*dev, &dir, "");
}
