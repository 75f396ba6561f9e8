//! `pwfs mount` as a process: it serves until SIGTERM and then leaves a clean image;
//! killed with SIGKILL in the middle of a write-heavy run, the next mount recovers
//! every fsync'd byte and the image passes fsck. Needs root and /dev/fuse (CI has
//! both); elsewhere it says so and does nothing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PWFS: &str = env!("CARGO_BIN_EXE_pwfs");

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

fn start(img: &Path, mp: &Path) -> Child {
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
    child
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
        // The dead mount point goes away; the image needs no help from it.
        let c = std::ffi::CString::new(mp.to_str().unwrap()).unwrap();
        // SAFETY: plain syscall with a valid C string.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
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
