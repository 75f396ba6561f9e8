//! `pwfs mount` as a process: it serves until SIGTERM and then leaves a clean image;
//! killed with SIGKILL in the middle of a write-heavy run, the next mount recovers
//! every fsync'd byte and the image passes fsck; killed right after `pwfs sync`, every
//! byte written before it. Needs root and /dev/fuse (CI has both); elsewhere it says
//! so and does nothing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const PWFS: &str = env!("CARGO_BIN_EXE_pwfs");

/// One mount test at a time: `pwfs sync` without a mount point reaches every daemon on
/// the machine, and another test's daemon dying under it would be its failure.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn can_mount() -> bool {
    // SAFETY: plain syscall.
    let ok = unsafe { libc::geteuid() } == 0 && Path::new("/dev/fuse").exists();
    if !ok {
        eprintln!("skipping: mount tests need root and /dev/fuse");
    }
    ok
}

fn mounted(mp: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let mp = mp.to_str().unwrap();
    mounts.lines().any(|l| l.split_whitespace().nth(1) == Some(mp))
}

/// A serving `pwfs mount`. A test that fails leaves none behind: it is killed and its
/// mount point detached, or it would hold the test's output pipe open and hang cargo.
struct Daemon(Child, PathBuf);

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

fn start(img: &Path, mp: &Path) -> Daemon {
    let child = Command::new(PWFS)
        .args(["mount", img.to_str().unwrap(), mp.to_str().unwrap(), "--size", "128M", "--cache", "16M"])
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
fn detach(mp: &Path) {
    let c = std::ffi::CString::new(mp.to_str().unwrap()).unwrap();
    // SAFETY: plain syscall with a valid C string.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

fn fsck(img: &Path) -> (bool, String) {
    let out = Command::new(PWFS).args(["fsck", img.to_str().unwrap()]).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn content(i: usize) -> Vec<u8> {
    (0..5000 + i * 3001).map(|k| (k * 7 + i) as u8).collect()
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pwfs-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("mnt")).unwrap();
    d
}

#[test]
fn sigterm_unmounts_cleanly_and_a_second_mount_is_refused() {
    let _serial = serial();
    if !can_mount() {
        return;
    }
    let d = dir("term");
    let (img, mp) = (d.join("i.img"), d.join("mnt"));
    let mut child = start(&img, &mp);
    std::fs::write(mp.join("f"), b"kept").unwrap();
    let second = Command::new(PWFS).args(["mount", img.to_str().unwrap(), d.to_str().unwrap()]).output().unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use"), "{}", String::from_utf8_lossy(&second.stderr));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert!(st.success(), "exit status {st}");
    assert!(!mounted(&mp));
    let (clean, report) = fsck(&img);
    assert!(clean && !report.contains("note:"), "{report}");
    let mut child = start(&img, &mp);
    assert_eq!(std::fs::read(mp.join("f")).unwrap(), b"kept");
    assert!(Command::new(PWFS).args(["umount", mp.to_str().unwrap()]).status().unwrap().success());
    assert!(child.wait().unwrap().success());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn sigkill_mid_workload_keeps_every_fsynced_byte() {
    let _serial = serial();
    if !can_mount() {
        return;
    }
    let d = dir("kill");
    let (img, mp) = (d.join("i.img"), d.join("mnt"));
    let mut synced = 0;
    for (round, kill_after) in [3usize, 11, 29].into_iter().enumerate() {
        let mut child = start(&img, &mp);
        // Everything synced before this round must be there.
        for i in 0..synced {
            assert_eq!(std::fs::read(mp.join(format!("f{i}"))).unwrap(), content(i), "round {round}: f{i}");
        }
        for k in 0..kill_after {
            let i = synced + k;
            let mut f = std::fs::File::create(mp.join(format!("f{i}"))).unwrap();
            f.write_all(&content(i)).unwrap();
            f.sync_all().unwrap();
        }
        synced += kill_after;
        // Unsynced writes in flight at the kill.
        let mut f = std::fs::File::create(mp.join("scratch")).unwrap();
        f.write_all(&vec![1u8; 3 << 20]).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        drop(f);
        detach(&mp);
        let (clean, report) = fsck(&img);
        assert!(clean, "round {round}: fsck of the crashed image: {report}");
    }
    let mut child = start(&img, &mp);
    for i in 0..synced {
        assert_eq!(std::fs::read(mp.join(format!("f{i}"))).unwrap(), content(i), "after the last kill: f{i}");
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let (clean, report) = fsck(&img);
    assert!(clean, "{report}");
    std::fs::remove_dir_all(&d).unwrap();
}

fn pwfs(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(PWFS).args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// Files of various sizes, and a directory with a few names (paths relative to the mount).
fn tree() -> Vec<(String, Vec<u8>)> {
    let sizes = [0, 1, 100, 4095, 4096, 4097, 10_000, 65_536 + 17, 1 << 20, (3 << 20) + 5];
    let mut t: Vec<(String, Vec<u8>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (format!("s{i}"), (0..n).map(|k| (k * 13 + i * 7 + k / 4096) as u8).collect()))
        .collect();
    for name in ["a", "bb", "with space", "ünïcödé", "x".repeat(200).as_str()] {
        t.push((format!("d/{name}"), name.as_bytes().repeat(3)));
    }
    t.push(("d/sub/deep".into(), vec![9; 5000]));
    t
}

#[test]
fn pwfs_sync_makes_unsynced_writes_survive_sigkill() {
    let _serial = serial();
    if !can_mount() {
        return;
    }
    let d = dir("sync");
    let (img, mp) = (d.join("i.img"), d.join("mnt"));
    let mp_s = mp.to_str().unwrap();
    let mut child = start(&img, &mp);
    // Live counters come from the socket.
    let (ok, stat, err) = pwfs(&["stat", mp_s]);
    assert!(ok, "{err}");
    let first = stat.lines().next().unwrap();
    assert!(first.starts_with("state") && first.ends_with(" read-write"), "{stat}");
    assert!(stat.lines().any(|l| l.starts_with("commit interval") && l.ends_with(" 5s")), "{stat}");
    // Plain writes, no fsync: durable only through `pwfs sync` (or the next commit).
    std::fs::create_dir_all(mp.join("d/sub")).unwrap();
    std::fs::create_dir(mp.join("d/empty")).unwrap();
    let files = tree();
    for (name, data) in &files {
        std::fs::write(mp.join(name), data).unwrap();
    }
    std::fs::rename(mp.join("s2"), mp.join("renamed")).unwrap();
    std::fs::remove_file(mp.join("s3")).unwrap();
    let (ok, out, err) = pwfs(&["sync", mp_s]);
    assert!(ok && out.is_empty() && err.is_empty(), "pwfs sync: {out}{err}");
    child.kill().unwrap();
    child.wait().unwrap();
    detach(&mp);
    let (clean, report) = fsck(&img);
    assert!(clean, "fsck of the killed image: {report}");
    let mut child = start(&img, &mp);
    for (name, data) in &files {
        let name = match name.as_str() {
            "s2" => "renamed",
            "s3" => {
                assert!(!mp.join("s3").exists(), "s3 was removed before the sync");
                continue;
            }
            n => n,
        };
        assert!(std::fs::read(mp.join(name)).unwrap() == *data, "{name} differs after the kill");
    }
    let names = |p: &Path| {
        let mut v: Vec<String> =
            std::fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    let mut want: Vec<String> = files
        .iter()
        .filter_map(|(n, _)| n.strip_prefix("d/").filter(|n| !n.contains('/')).map(String::from))
        .chain(["empty".into(), "sub".into()])
        .collect();
    want.sort();
    assert_eq!(names(&mp.join("d")), want);
    assert!(names(&mp.join("d/empty")).is_empty());
    assert_eq!(names(&mp.join("d/sub")), ["deep"]);
    // Every mount of the machine, this one among them.
    let (ok, out, err) = pwfs(&["sync"]);
    assert!(ok && out.is_empty(), "pwfs sync (all): {out}{err}");
    // Not a pwfs mount, and no such directory: a clear refusal.
    for p in [d.to_str().unwrap(), "/nonexistent-pwfs-dir"] {
        let (ok, _, err) = pwfs(&["sync", p]);
        assert!(!ok && err.contains(&format!("pwfs: {p}: no pwfs mounted there")), "{err}");
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let (clean, report) = fsck(&img);
    assert!(clean && !report.contains("note:"), "{report}");
    std::fs::remove_dir_all(&d).unwrap();
}
