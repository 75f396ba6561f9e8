#![allow(dead_code)]
//! Helpers of the tests that run `pwfs mount` as a process.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const PWFS: &str = env!("CARGO_BIN_EXE_pwfs");

/// One mount test at a time: `pwfs sync` without a mount point reaches every daemon on
/// the machine, and another test's daemon dying under it would be its failure.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn can_mount() -> bool {
    // SAFETY: plain syscall.
    let ok = unsafe { libc::geteuid() } == 0 && Path::new("/dev/fuse").exists();
    if !ok {
        assert!(
            std::env::var_os("PWFS_REQUIRE_FUSE").is_none(),
            "PWFS_REQUIRE_FUSE: mount tests need root and /dev/fuse"
        );
        eprintln!("skipping: mount tests need root and /dev/fuse");
    }
    ok
}

pub fn mounted(mp: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let mp = mp.to_str().unwrap();
    mounts.lines().any(|l| l.split_whitespace().nth(1) == Some(mp))
}

/// A serving `pwfs mount`. A test that fails leaves none behind: it is killed and its
/// mount point detached, or it would hold the test's output pipe open and hang cargo.
pub struct Daemon(pub Child, pub PathBuf);

impl std::ops::Deref for Daemon {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Daemon {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
            detach(&self.1);
        }
    }
}

pub fn start(img: &Path, mp: &Path) -> Daemon {
    start_with(img, mp, &[])
}

/// `start` with more options for `pwfs mount`.
pub fn start_with(img: &Path, mp: &Path, extra: &[&str]) -> Daemon {
    let child = Command::new(PWFS)
        .args(["mount", img.to_str().unwrap(), mp.to_str().unwrap(), "--size", "128M", "--cache", "16M"])
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !mounted(mp) {
        assert!(t.elapsed() < Duration::from_secs(20), "pwfs mount did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon(child, mp.to_path_buf())
}

/// Lazily detach the mount point of a killed daemon; the image needs no help from it.
pub fn detach(mp: &Path) {
    let c = std::ffi::CString::new(mp.to_str().unwrap()).unwrap();
    // SAFETY: plain syscall with a valid C string.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

pub fn fsck(img: &Path) -> (bool, String) {
    let out = Command::new(PWFS).args(["fsck", img.to_str().unwrap()]).output().unwrap();
    // Why it could not check ("in use") is on stderr.
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

pub fn content(i: usize) -> Vec<u8> {
    (0..5000 + i * 3001).map(|k| (k * 7 + i) as u8).collect()
}

pub fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pwfs-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("mnt")).unwrap();
    d
}

pub fn pwfs(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(PWFS).args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
