//! The LD_PRELOAD shim (libpwfs_preload.so) against a serving `pwfs mount`: programs
//! run with it see the same bytes as programs using the mount, before and after a
//! fork, a dup2 and an exec; O_APPEND writers through both ways interleave whole
//! records; a daemon killed mid-request makes the client fail with EIO, never hang;
//! a client killed mid-request gets its channel freed. Needs root and /dev/fuse (CI has
//! both); elsewhere it says so and does nothing.
//!
//! The shim side of each test is this test binary itself, run again with LD_PRELOAD
//! and a role in `PWFS_SHIM_ROLE` (the ignored test `role`): its calls through std
//! and libc are the interposed ones.

mod common;

use common::*;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The shim, built next to this test (target/PROFILE/libpwfs_preload.so). `cargo test`
/// does not build a package's cdylib, so it is built here once, in this test's
/// profile and target directory (read off this executable's path), from the source
/// under test; cargo has released the build lock by the time tests run.
fn preload() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe.parent().and_then(Path::parent).expect("<target>/<profile>/deps/<test>");
            let target = profile_dir.parent().expect("<target>/<profile>");
            let profile = match profile_dir.file_name().and_then(|n| n.to_str()).expect("profile dir") {
                "debug" => "dev".to_string(),
                other => other.to_string(),
            };
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let st = Command::new(cargo)
                .args(["build", "--locked", "-p", "pwfs-preload", "--lib", "--profile", &profile, "--target-dir"])
                .arg(target)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .unwrap();
            assert!(st.success(), "cargo build -p pwfs-preload failed");
            let p = profile_dir.join("libpwfs_preload.so");
            assert!(p.exists(), "no {}", p.display());
            p
        })
        .clone()
}

/// This binary again, with the shim, playing `role` with `args`.
fn shim_child(role: &str, args: &[&str]) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--ignored", "--exact", "role", "--nocapture", "--test-threads=1"])
        .env("LD_PRELOAD", preload())
        .env("PWFS_SHIM_ROLE", role)
        .env("PWFS_SHIM_ARGS", args.join("\n"))
        .stdin(Stdio::null());
    c
}

fn run_shim(role: &str, args: &[&str]) -> String {
    let out = shim_child(role, args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "role {role} failed: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// A line `@key value` a role printed (the test harness prints around it).
fn value(out: &str, key: &str) -> u64 {
    out.lines()
        .find_map(|l| l.split_once(&format!("@{key} ")).and_then(|(_, v)| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {key} in {out}"))
}

/// Wait for a role's `@ready`.
fn ready(kid: &mut Child) -> std::io::Lines<BufReader<std::process::ChildStdout>> {
    let mut lines = BufReader::new(kid.stdout.take().unwrap()).lines();
    for l in lines.by_ref() {
        if l.unwrap().contains("@ready") {
            return lines;
        }
    }
    panic!("the role ended before it was ready");
}

/// Requests this process sent through the shim (0 without it).
fn carried() -> u64 {
    // SAFETY: dlsym of a symbol the shim exports, called with its own signature.
    unsafe {
        let p = libc::dlsym(libc::RTLD_DEFAULT, c"pwfs_preload_requests".as_ptr());
        if p.is_null() {
            return 0;
        }
        let f: extern "C" fn() -> u64 = std::mem::transmute(p);
        f()
    }
}

fn stat_line(mp: &Path, key: &str) -> u64 {
    let (ok, out, err) = pwfs(&["stat", mp.to_str().unwrap()]);
    assert!(ok, "{err}");
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.split_whitespace().next()?.parse().ok()))
        .unwrap_or_else(|| panic!("no {key:?} in {out}"))
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

/// The roles, run under the shim.
#[test]
#[ignore = "the shim side of the tests in this file, run by them"]
fn role() {
    let Ok(role) = std::env::var("PWFS_SHIM_ROLE") else { return };
    let args: Vec<String> = std::env::var("PWFS_SHIM_ARGS").unwrap().lines().map(String::from).collect();
    let path = Path::new(&args[0]);
    match role.as_str() {
        "write" => role_write(path),
        "read" => {
            let data = std::fs::read(path).unwrap();
            println!("\n@len {}", data.len());
            println!("@sum {}", data.iter().map(|b| *b as u64).sum::<u64>());
        }
        "append" => {
            let tag = args[1].as_bytes()[0];
            let n: usize = args[2].parse().unwrap();
            let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
            for i in 0..n {
                f.write_all(&record(tag, i)).unwrap();
            }
        }
        "fork" => role_fork(path),
        "mmap" => role_mmap(path),
        "shared-writers" => role_shared_writers(path),
        "loop" => role_loop(path),
        "sync" => {
            std::fs::write(path, pattern(100_000, 9)).unwrap();
            // SAFETY: sync(2).
            unsafe { libc::sync() };
            // Pages only the kernel holds dirty (a shared mapping's, its descriptor
            // closed) reach the daemon before a carried fsync of another descriptor
            // commits. (sync and syncfs write them back first too, but this kernel
            // does not wait for a FUSE server's write-back in sync: not checked.)
            mapped_write(&path.with_extension("m3"), 12);
            std::fs::OpenOptions::new().write(true).open(path.with_extension("m3")).unwrap().sync_all().unwrap();
        }
        "setfl" => {
            // O_APPEND cleared through one descriptor of a description holds for its
            // duplicate too (registered while it appended).
            std::fs::write(path, b"hello").unwrap();
            let a = std::fs::OpenOptions::new().append(true).open(path).unwrap();
            // SAFETY: dup, fcntl, lseek and write on open descriptors.
            unsafe {
                let b = libc::dup(a.as_raw_fd());
                assert_eq!(libc::write(b, b"1".as_ptr() as *const libc::c_void, 1), 1);
                assert_eq!(libc::fcntl(a.as_raw_fd(), libc::F_SETFL, 0), 0);
                assert_eq!(libc::lseek(b, 0, libc::SEEK_SET), 0);
                assert_eq!(libc::write(b, b"X".as_ptr() as *const libc::c_void, 1), 1);
                libc::close(b);
            }
        }
        "vfork" => {
            // A vfork child (CPython's subprocess) closing descriptors before its exec
            // closes its own: the parent's carried descriptor keeps its handle.
            let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap();
            f.write_all_at(b"one", 0).unwrap();
            let fd = f.as_raw_fd();
            // The child as posix_spawn makes it: clone(CLONE_VM | CLONE_VFORK) on a
            // stack of its own, in this process's memory, this thread suspended until
            // it exits (libc::vfork returns twice, which Rust cannot express).
            extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
                // SAFETY: close, close_range and _exit only (async-signal safe).
                unsafe {
                    libc::close(arg as usize as libc::c_int);
                    libc::close_range(3, libc::c_uint::MAX, 0);
                    libc::_exit(0)
                }
            }
            let mut stack = vec![0u8; 256 << 10];
            // SAFETY: the child's stack is ours and outlives it (CLONE_VFORK: clone
            // returns once the child has exited); waitpid of our own child.
            unsafe {
                let top = stack.as_mut_ptr().add(stack.len()) as *mut libc::c_void;
                let pid = libc::clone(
                    child,
                    top,
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                    fd as usize as *mut libc::c_void,
                );
                assert!(pid > 0, "clone: {}", std::io::Error::last_os_error());
                let mut status = 0;
                assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            }
            f.write_all_at(b"two", 3).unwrap();
        }
        r => panic!("unknown role {r}"),
    }
    println!("\n@carried {}", carried());
}

/// Every data call the shim carries, on one file; the parent checks the result
/// through the mount.
fn role_write(path: &Path) {
    let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap();
    let a = pattern(300_000, 1);
    f.write_all(&a).unwrap(); // write(2)
    f.write_all_at(b"PWRITE", 4096).unwrap(); // pwrite64
    let n = f.write_vectored(&[std::io::IoSlice::new(b"vec"), std::io::IoSlice::new(b"tor")]).unwrap(); // writev
    assert_eq!(n, 6);
    assert_eq!(f.stream_position().unwrap(), 300_006);
    assert_eq!(f.seek(SeekFrom::End(-6)).unwrap(), 300_000); // SEEK_END: the daemon's size
    let mut back = [0u8; 6];
    f.read_exact(&mut back).unwrap(); // read(2) at the kernel's position
    assert_eq!(&back, b"vector");
    let mut at = [0u8; 6];
    f.read_exact_at(&mut at, 4096).unwrap(); // pread64
    assert_eq!(&at, b"PWRITE");
    assert_eq!(f.metadata().unwrap().len(), 300_006); // statx of the descriptor
    f.set_len(1 << 20).unwrap(); // ftruncate
                                 // SAFETY: lseek and fallocate of our own descriptor.
    unsafe {
        let fd = f.as_raw_fd();
        if carried() > 0 {
            // The engine's answer, through the shim.
            assert_eq!(libc::lseek(fd, 400_000, libc::SEEK_DATA), -1, "a hole up to the end");
            assert_eq!(*libc::__errno_location(), libc::ENXIO);
            assert_eq!(libc::lseek(fd, 0, libc::SEEK_HOLE), 303_104, "the first hole: after the written blocks");
        } else {
            // Through the kernel's cache: the kernel answers from the size (the mount
            // cannot see its dirty pages; docs/DECISIONS.md).
            assert_eq!(libc::lseek(fd, 400_000, libc::SEEK_DATA), 400_000);
            assert_eq!(libc::lseek(fd, 0, libc::SEEK_HOLE), 1 << 20);
        }
        assert_eq!(libc::fallocate(fd, 0, 2 << 20, 4096), 0);
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(fd, &mut st), 0);
        assert_eq!(st.st_size, (2 << 20) + 4096);
        assert_eq!(libc::fdatasync(fd), 0);
        // Not open for writing: the kernel's errno.
        let ro = std::fs::File::open(path).unwrap();
        assert_eq!(libc::write(ro.as_raw_fd(), b"x".as_ptr() as *const libc::c_void, 1), -1);
        assert_eq!(*libc::__errno_location(), libc::EBADF);
        assert_eq!(libc::ftruncate(ro.as_raw_fd(), 0), -1);
        assert_eq!(*libc::__errno_location(), libc::EINVAL);
        // Zero bytes: the kernel's answers too.
        assert_eq!(libc::write(ro.as_raw_fd(), b"x".as_ptr() as *const libc::c_void, 0), -1);
        assert_eq!(*libc::__errno_location(), libc::EBADF);
        let wo = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(libc::read(wo.as_raw_fd(), byte.as_mut_ptr() as *mut libc::c_void, 0), -1);
        assert_eq!(*libc::__errno_location(), libc::EBADF);
        assert_eq!(libc::pwrite(fd, b"x".as_ptr() as *const libc::c_void, 0, -1), -1);
        assert_eq!(*libc::__errno_location(), libc::EINVAL);
        assert_eq!(libc::write(fd, b"x".as_ptr() as *const libc::c_void, 0), 0);
        assert_eq!(libc::pread(fd, byte.as_mut_ptr() as *mut libc::c_void, 0, 5), 0);
        // RWF_APPEND (the kernel's path) appends at the end the shim's writes made,
        // not at the size the kernel last saw (0).
        let app = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path.with_extension("app"))
            .unwrap();
        app.write_all_at(&[7u8; 100_000], 0).unwrap();
        let iov = libc::iovec { iov_base: b"APP".as_ptr() as *mut libc::c_void, iov_len: 3 };
        assert_eq!(libc::pwritev2(app.as_raw_fd(), &iov, 1, -1, libc::RWF_APPEND), 3);
        let mut tail = [0u8; 4];
        app.read_exact_at(&mut tail, 100_000 - 1).unwrap();
        assert_eq!(&tail, b"\x07APP", "RWF_APPEND at the end");
    }
    f.sync_all().unwrap();
}

/// A file grown through the shim (ftruncate, then a write past the end) is mapped and
/// touched at its new end through the kernel, which must know the new size (a page
/// fault past the size it caches is SIGBUS), and what the mapping stores is what the
/// shim reads.
fn role_mmap(path: &Path) {
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap();
    // The kernel looks at the file first (so it caches its size, 0).
    assert_eq!(std::fs::metadata(path).unwrap().len(), 0);
    f.set_len(64 << 10).unwrap();
    f.write_all_at(b"tail", (128 << 10) - 4).unwrap();
    // SAFETY: a shared mapping of our own file, 128 KiB long, used and unmapped here.
    unsafe {
        let len = 128 << 10;
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let b = p as *mut u8;
        assert_eq!(std::slice::from_raw_parts(b.add(len - 4), 4), b"tail");
        *b.add(len - 8) = b'M';
        *b.add(70_000) = b'Z';
        assert_eq!(libc::msync(p, len, libc::MS_SYNC), 0);
        assert_eq!(libc::munmap(p, len), 0);
    }
    let mut back = [0u8; 1];
    f.read_exact_at(&mut back, 70_000).unwrap();
    assert_eq!(&back, b"Z");
    f.read_exact_at(&mut back, (128 << 10) - 8).unwrap();
    assert_eq!(&back, b"M");
    // A store of another descriptor's shared mapping, not written back yet, is data to
    // a carried SEEK_DATA (`cp --sparse` copied zeros for it).
    let sparse = path.with_extension("sparse");
    let g = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&sparse).unwrap();
    g.set_len(1 << 20).unwrap();
    let h = std::fs::OpenOptions::new().read(true).write(true).open(&sparse).unwrap();
    // SAFETY: a shared mapping of our own 1 MiB file, used and unmapped here; lseek of
    // our own descriptor.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            1 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            h.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        *(p as *mut u8).add(512 << 10) = b'S';
        // (Still mapped: FUSE writes a mapping's pages back when it is unmapped.)
        assert_eq!(libc::lseek(g.as_raw_fd(), 0, libc::SEEK_DATA), 512 << 10, "the mapped store is data");
        assert_eq!(libc::munmap(p, 1 << 20), 0);
    }
}

/// Two forked children and two threads write records through one inherited
/// descriptor (no O_APPEND, as `make -j > log`): the shared file position must hand
/// every write its own place.
fn role_shared_writers(path: &Path) {
    let f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path).unwrap();
    let fd = f.as_raw_fd();
    let write = |tag: u8| {
        for i in 0..400 {
            let r = record(tag, i);
            // SAFETY: write(2) of a live buffer to our descriptor.
            assert_eq!(unsafe { libc::write(fd, r.as_ptr() as *const libc::c_void, r.len()) }, 64);
        }
    };
    // Two threads while the description is still this process's own (the shim moves
    // the position, under its lock), then two children sharing it (the kernel does).
    std::thread::scope(|s| {
        s.spawn(|| write(b'r'));
        s.spawn(|| write(b's'));
    });
    let mut kids = Vec::new();
    for tag in [b'p', b'q'] {
        // SAFETY: fork; the child writes and exits without returning.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            write(tag);
            // SAFETY: leaving the child.
            unsafe { libc::_exit(0) };
        }
        kids.push(pid);
    }
    for pid in kids {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}

/// A 64-byte record: tag, index, filler, newline.
fn record(tag: u8, i: usize) -> Vec<u8> {
    let mut r = format!("{}{:08}", tag as char, i).into_bytes();
    r.resize(63, tag);
    r.push(b'\n');
    r
}

/// The file position is shared by a descriptor, its fork, its dup and an exec'd
/// program; close-on-exec closes.
fn role_fork(path: &Path) {
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path).unwrap();
    f.write_all(b"A").unwrap();
    // SAFETY: fork, write through the inherited descriptor, and exit in the child.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0);
        if pid == 0 {
            let ok = libc::write(f.as_raw_fd(), b"B".as_ptr() as *const libc::c_void, 1) == 1;
            libc::_exit(if ok { 0 } else { 1 });
        }
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's write failed");
    }
    f.write_all(b"C").unwrap();
    // SAFETY: dup2 onto a free number, a write through it, and dup3 with O_CLOEXEC.
    unsafe {
        assert_eq!(libc::dup2(f.as_raw_fd(), 8), 8);
        assert_eq!(libc::write(8, b"D".as_ptr() as *const libc::c_void, 1), 1);
        assert_eq!(libc::dup3(f.as_raw_fd(), 9, libc::O_CLOEXEC), 9);
    }
    // fd 8 is inherited by the program (which runs with the shim too).
    let st = Command::new("sh").args(["-c", "printf E >&8"]).status().unwrap();
    assert!(st.success());
    let st = Command::new("sh").args(["-c", "printf F >&9"]).stderr(Stdio::null()).status().unwrap();
    assert!(!st.success(), "a close-on-exec descriptor survived exec");
    // SAFETY: closing our dups.
    unsafe {
        libc::close(8);
        libc::close(9);
    }
    f.write_all(b"G").unwrap();
    assert_eq!(f.stream_position().unwrap(), 6);
}

/// Create `path` (64 KiB), map it shared, close it (its flush writes back what is
/// dirty then), and write `pattern(65536, seed)` through the mapping: pages only the
/// kernel holds dirty. The mapping stays.
fn mapped_write(path: &Path, seed: u8) {
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap();
    f.set_len(65536).unwrap();
    // SAFETY: a shared mapping of 64 KiB of an open file, written after the close.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), 65536, libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd(), 0);
        assert_ne!(p, libc::MAP_FAILED);
        drop(f);
        std::ptr::copy_nonoverlapping(pattern(65536, seed).as_ptr(), p as *mut u8, 65536);
    }
}

/// Write and fsync until something fails; say "ready" after the first round. Exit 0
/// if what failed was EIO or ENOTCONN (the daemon went away), 3 otherwise.
fn role_loop(path: &Path) {
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path).unwrap();
    let block = pattern(1 << 20, 3);
    for round in 0.. {
        let r = f.write_all(&block).and_then(|_| f.sync_all());
        match r {
            Ok(()) if round == 0 => {
                println!("\n@ready");
                std::io::stdout().flush().unwrap();
            }
            Ok(()) => {
                if round % 8 == 0 {
                    f.set_len(0).unwrap();
                    f.rewind().unwrap();
                }
            }
            Err(e) => {
                println!("\n@error {e}");
                let code = match e.raw_os_error() {
                    Some(libc::EIO) | Some(libc::ENOTCONN) => 0,
                    _ => 3,
                };
                std::process::exit(code);
            }
        }
    }
}

struct Mount {
    daemon: Daemon,
    dir: PathBuf,
    img: PathBuf,
    mp: PathBuf,
}

impl Drop for Mount {
    /// The daemon stopped, then its directory removed (its 128 MiB image was left
    /// behind by every run).
    fn drop(&mut self) {
        if let Ok(None) = self.daemon.0.try_wait() {
            let _ = self.daemon.0.kill();
            let _ = self.daemon.0.wait();
        }
        detach(&self.mp);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn mount(name: &str) -> Mount {
    let dir = dir(&format!("shim-{name}"));
    let (img, mp) = (dir.join("i.img"), dir.join("mnt"));
    let d = start(&img, &mp);
    Mount { daemon: d, dir, img, mp }
}

#[test]
fn shim_and_mount_see_the_same_bytes_both_ways() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("same");
    let f = m.mp.join("f");
    let out = run_shim("write", &[f.to_str().unwrap()]);
    assert!(value(&out, "carried") > 10, "calls were not carried: {out}");
    // Through the mount, right away: the kernel's cached attributes and pages were dropped.
    let data = std::fs::read(&f).unwrap();
    assert_eq!(data.len(), (2 << 20) + 4096);
    let mut want = pattern(300_000, 1);
    want[4096..4102].copy_from_slice(b"PWRITE");
    want.extend_from_slice(b"vector");
    assert!(data[..want.len()] == want[..], "the shim's bytes differ through the mount");
    assert!(data[want.len()..].iter().all(|b| *b == 0));
    assert_eq!(std::fs::metadata(&f).unwrap().len(), (2 << 20) + 4096);
    // The other way: written through the mount (the kernel caches it), read through the shim.
    let g = m.mp.join("g");
    let b = pattern(123_457, 5);
    std::fs::write(&g, &b).unwrap();
    assert_eq!(std::fs::read(&g).unwrap(), b);
    let out = run_shim("read", &[g.to_str().unwrap()]);
    assert_eq!(value(&out, "len"), b.len() as u64);
    assert_eq!(value(&out, "sum"), b.iter().map(|x| *x as u64).sum::<u64>());
    // Then changed through the shim again within the same second: the mount sees it.
    run_shim("write", &[g.to_str().unwrap()]);
    assert_eq!(std::fs::read(&g).unwrap().len(), (2 << 20) + 4096);
    assert!(stat_line(&m.mp, "shim files registered") >= 3);
    assert!(stat_line(&m.mp, "shim requests") > 20);
}

#[test]
fn o_append_writers_through_the_shim_and_the_mount_lose_no_record() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("append");
    let f = m.mp.join("log");
    std::fs::write(&f, b"").unwrap();
    const N: usize = 1500;
    let kids: Vec<Child> = ["a", "b"]
        .iter()
        .map(|t| shim_child("append", &[f.to_str().unwrap(), t, &N.to_string()]).stdout(Stdio::null()).spawn().unwrap())
        .collect();
    // And one writer through the mount itself, at the same time.
    let mut w = std::fs::OpenOptions::new().append(true).open(&f).unwrap();
    for i in 0..N {
        w.write_all(&record(b'k', i)).unwrap();
    }
    for mut k in kids {
        assert!(k.wait().unwrap().success());
    }
    let data = std::fs::read(&f).unwrap();
    assert_eq!(data.len(), 3 * N * 64, "records were lost or overwritten");
    let mut next = [0usize; 3];
    for r in data.chunks(64) {
        let t = ["a", "b", "k"].iter().position(|t| t.as_bytes()[0] == r[0]).expect("a torn record");
        assert_eq!(r, &record(r[0], next[t])[..], "records out of order or torn");
        next[t] += 1;
    }
    assert_eq!(next, [N; 3]);
}

#[test]
fn writers_sharing_one_position_never_overwrite_each_other() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("shared-pos");
    let f = m.mp.join("log");
    run_shim("shared-writers", &[f.to_str().unwrap()]);
    let data = std::fs::read(&f).unwrap();
    assert_eq!(data.len(), 4 * 400 * 64, "writes through a shared position overwrote each other");
    let mut next = [0usize; 4];
    for r in data.chunks(64) {
        let t = b"pqrs".iter().position(|t| *t == r[0]).expect("a torn record");
        assert_eq!(r, &record(r[0], next[t])[..]);
        next[t] += 1;
    }
}

#[test]
fn fork_dup2_exec_share_the_position_and_close_on_exec_closes() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("fork");
    let f = m.mp.join("f");
    let out = run_shim("fork", &[f.to_str().unwrap()]);
    assert!(value(&out, "carried") > 0, "{out}");
    assert_eq!(std::fs::read(&f).unwrap(), b"ABCDEG");
}

#[test]
fn a_vfork_child_closing_descriptors_leaves_the_parents_alone() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("vfork");
    let f = m.mp.join("f");
    let out = run_shim("vfork", &[f.to_str().unwrap()]);
    assert!(value(&out, "carried") > 0, "{out}");
    assert_eq!(std::fs::read(&f).unwrap(), b"onetwo");
    assert_eq!(stat_line(&m.mp, "shim files registered"), 1, "the parent's handle was not released");
}

#[test]
fn a_mapping_of_a_file_grown_through_the_shim_reaches_its_new_end() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("mmap");
    let f = m.mp.join("f");
    let out = run_shim("mmap", &[f.to_str().unwrap()]);
    assert!(value(&out, "carried") > 0, "{out}");
    let data = std::fs::read(&f).unwrap();
    assert_eq!(data.len(), 128 << 10);
    assert_eq!((data[70_000], data[(128 << 10) - 8], &data[(128 << 10) - 4..]), (b'Z', b'M', &b"tail"[..]));
}

#[test]
fn o_append_cleared_through_one_descriptor_holds_for_its_duplicate() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("setfl");
    let f = m.mp.join("f");
    run_shim("setfl", &[f.to_str().unwrap()]);
    assert_eq!(std::fs::read(&f).unwrap(), b"Xello1");
}

#[test]
fn sync_through_the_shim_makes_writes_survive_sigkill() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let mut m = mount("sync");
    let f = m.mp.join("f");
    run_shim("sync", &[f.to_str().unwrap()]);
    m.daemon.kill().unwrap();
    m.daemon.wait().unwrap();
    detach(&m.mp);
    let d2 = start(&m.img, &m.mp);
    assert_eq!(std::fs::read(&f).unwrap(), pattern(100_000, 9));
    let got = std::fs::read(f.with_extension("m3")).unwrap_or_default();
    assert!(got == pattern(65536, 12), "the mapping's bytes were not made durable by the fsync");
    drop(d2);
}

#[test]
fn a_daemon_killed_mid_request_fails_the_client_with_eio_not_a_hang() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let mut m = mount("daemon-dies");
    let mut kid = shim_child("loop", &[m.mp.join("f").to_str().unwrap()]).stdout(Stdio::piped()).spawn().unwrap();
    let lines = ready(&mut kid);
    std::thread::sleep(Duration::from_millis(50));
    m.daemon.kill().unwrap();
    m.daemon.wait().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = kid.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the client hangs after the daemon died");
        std::thread::sleep(Duration::from_millis(20));
    };
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(status.success(), "the client failed otherwise than with EIO/ENOTCONN: {rest:?}");
    detach(&m.mp);
}

#[test]
fn a_client_killed_mid_request_gets_its_channel_freed() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let m = mount("client-dies");
    let mut kid = shim_child("loop", &[m.mp.join("f").to_str().unwrap()]).stdout(Stdio::piped()).spawn().unwrap();
    let _lines = ready(&mut kid);
    assert!(stat_line(&m.mp, "shim threads") >= 1);
    assert_eq!(stat_line(&m.mp, "shim processes"), 1);
    kid.kill().unwrap();
    kid.wait().unwrap();
    wait_for("the daemon to free the dead client's channel", || {
        stat_line(&m.mp, "shim threads") == 0 && stat_line(&m.mp, "shim processes") == 0
    });
    // And the mount still serves, through the shim too.
    let f = m.mp.join("after");
    run_shim("write", &[f.to_str().unwrap()]);
    assert_eq!(std::fs::metadata(&f).unwrap().len(), (2 << 20) + 4096);
    let _ = std::fs::remove_dir_all(&m.dir);
}

#[test]
fn a_mount_without_the_shim_serves_shim_clients_through_the_kernel() {
    let _s = serial();
    if !can_mount() {
        return;
    }
    let dir = dir("shim-off");
    let (img, mp) = (dir.join("i.img"), dir.join("mnt"));
    let child = Command::new(PWFS)
        .args(["mount", img.to_str().unwrap(), mp.to_str().unwrap(), "--size", "128M", "--shim", "off"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the mount", || mounted(&mp));
    let _m = Mount { daemon: Daemon(child, mp.clone()), dir, img, mp: mp.clone() };
    let out = run_shim("write", &[mp.join("f").to_str().unwrap()]);
    assert_eq!(value(&out, "carried"), 0);
    assert_eq!(std::fs::metadata(mp.join("f")).unwrap().len(), (2 << 20) + 4096);
}
