//! Running one cell of a bench under a memory limit: a child process in a memory
//! cgroup of its own, so that the kernel's page cache it fills is bounded as pwfs's
//! own cache is by `Config::cache_bytes`. The limit counts all of the child's memory
//! (page cache, its threads' stacks and buffers, kernel objects); under cgroup v1
//! there is no per-cgroup dirty throttling, so a writer there is held back by
//! reclaim writing its pages back rather than by `balance_dirty_pages`.
//!
//! The child is a fork of the bench (no exec): it moves itself into the cgroup, runs
//! the cell (threads and `std::fs` calls only; it never touches an `Fs` of the
//! parent, whose threads do not exist in the child) and sends its figure back over a
//! pipe. Page-cache pages are charged to the cgroup of the process whose access
//! brings them in, so the child's reads and writes — of ext4 files, or of a FUSE
//! mount's files in the kernel's cache — count against the limit, and the parent's
//! do not. Both cgroup versions work: v2 (`memory.max`, where the unified hierarchy
//! has the memory controller, which is then enabled for the root's children) and v1
//! (`memory.limit_in_bytes`).
//!
//! A child that hangs (it inherits the parent's memory as it was at the fork, locks
//! included: a lock another thread held then stays held) is killed after the
//! caller's timeout, and the call fails.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A memory cgroup made for one bench; removed when dropped.
pub struct Limit {
    dir: PathBuf,
    bytes: u64,
}

impl Limit {
    /// A new cgroup whose processes may hold `bytes` of memory (page cache included).
    pub fn new(bytes: u64) -> Result<Limit, String> {
        let name = format!("pwfs-bench-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let (dir, knob) = if let Some(root) = v2_root() {
            (root.join(&name), "memory.max")
        } else if Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() {
            (PathBuf::from("/sys/fs/cgroup/memory").join(&name), "memory.limit_in_bytes")
        } else {
            return Err("no memory cgroup controller (neither cgroup v2 with memory nor v1 memory)".into());
        };
        fs::create_dir(&dir).map_err(|e| format!("memory cgroup {}: {e}", dir.display()))?;
        let limit = Limit { dir, bytes };
        let knob = limit.dir.join(knob);
        fs::write(&knob, bytes.to_string()).map_err(|e| format!("{}: {e}", knob.display()))?;
        Ok(limit)
    }

    /// The limit, in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Run `cell` in a child process inside the cgroup and return its figure. The
    /// child's failure (an error, a panic, or a kill, such as the out-of-memory
    /// killer's) is the call's error.
    pub fn run(&self, timeout: Duration, cell: impl FnOnce() -> Result<f64, String>) -> Result<f64, String> {
        let procs = self.dir.join("cgroup.procs");
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two descriptors.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("pipe: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fork; the child runs only `cell` (threads and file system calls of its
        // own) and leaves with _exit, never returning into the parent's code.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: both descriptors are ours.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
            return Err(format!("fork: {e}"));
        }
        if pid == 0 {
            // SAFETY: the child owns its copy of the write end; the read end is closed.
            let mut out = unsafe {
                libc::close(fds[0]);
                fs::File::from_raw_fd(fds[1])
            };
            let answer = match fs::write(&procs, std::process::id().to_string()) {
                Err(e) => format!("err join {}: {e}", procs.display()),
                Ok(()) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(cell)) {
                    Ok(Ok(v)) => format!("ok {v}"),
                    Ok(Err(e)) => format!("err {e}"),
                    Err(_) => "err the cell panicked".to_string(),
                },
            };
            let _ = out.write_all(answer.as_bytes());
            drop(out);
            // SAFETY: leave without running the parent's exit handlers or destructors.
            unsafe { libc::_exit(0) };
        }
        // SAFETY: the parent owns the read end; its copy of the write end is closed so
        // that the read sees the end of the child's answer.
        let mut input = unsafe {
            libc::close(fds[1]);
            fs::File::from_raw_fd(fds[0])
        };
        let read = read_until(&mut input, Instant::now() + timeout);
        if read.is_err() {
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return Err(format!("waitpid: {}", std::io::Error::last_os_error()));
            }
        }
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            let oom = if sig == libc::SIGKILL { " (out of memory under the limit?)" } else { "" };
            return Err(format!("cell under a {} MiB memory limit: killed by signal {sig}{oom}", self.bytes >> 20));
        }
        let answer = read.map_err(|e| format!("reading the cell's answer: {e}"))?;
        match answer.split_once(' ') {
            Some(("ok", v)) => v.parse().map_err(|e| format!("cell answered {answer:?}: {e}")),
            Some(("err", e)) => Err(e.to_string()),
            _ => Err(format!("cell answered {answer:?} (status {status})")),
        }
    }
}

/// Everything the child writes to the pipe, until it closes it; an error once
/// `deadline` passes first.
fn read_until(input: &mut fs::File, deadline: Instant) -> std::io::Result<String> {
    use std::os::fd::AsRawFd;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the cell ran past its timeout"));
        }
        let mut p = libc::pollfd { fd: input.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd of a descriptor we own.
        let n = unsafe { libc::poll(&mut p, 1, left.as_millis().clamp(1, i32::MAX as u128) as i32) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            continue;
        }
        match input.read(&mut chunk) {
            Ok(0) => return Ok(String::from_utf8_lossy(&answer).into_owned()),
            Ok(k) => answer.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

impl Drop for Limit {
    fn drop(&mut self) {
        // The children are gone, so the rmdir succeeds; page cache still charged here
        // moves to the parent (v1) or stays with the removed cgroup until it is
        // reclaimed (v2).
        let _ = fs::remove_dir(&self.dir);
    }
}

/// The unified hierarchy's root if the memory controller is on it and can be enabled
/// for children.
fn v2_root() -> Option<PathBuf> {
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let root = PathBuf::from(root);
        let Ok(controllers) = fs::read_to_string(root.join("cgroup.controllers")) else { continue };
        if !controllers.split_whitespace().any(|c| c == "memory") {
            continue;
        }
        let sub = root.join("cgroup.subtree_control");
        let on = fs::read_to_string(&sub).is_ok_and(|s| s.split_whitespace().any(|c| c == "memory"));
        if on || fs::write(&sub, "+memory").is_ok() {
            return Some(root);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        // SAFETY: getuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn a_cell_runs_in_the_cgroup_and_reports_its_figure() {
        if !root() {
            eprintln!("skipped: needs root for cgroups");
            return;
        }
        let limit = match Limit::new(64 << 20) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let dir = limit.dir.clone();
        let minute = Duration::from_secs(60);
        let v = limit
            .run(minute, || {
                let mine = fs::read_to_string(dir.join("cgroup.procs")).map_err(|e| e.to_string())?;
                let me = std::process::id().to_string();
                if mine.lines().any(|l| l == me) {
                    Ok(42.5)
                } else {
                    Err(format!("{me} not in {mine:?}"))
                }
            })
            .unwrap();
        assert_eq!(v, 42.5);
        let e = limit.run(minute, || Err("no luck".into())).unwrap_err();
        assert_eq!(e, "no luck");
        let e = limit.run(minute, || panic!("boom")).unwrap_err();
        assert!(e.contains("panicked"), "{e}");
        let e = limit
            .run(Duration::from_millis(200), || {
                std::thread::sleep(Duration::from_secs(30));
                Ok(1.0)
            })
            .unwrap_err();
        assert!(e.contains("signal 9"), "a cell past its timeout is killed: {e}");
    }

    #[test]
    fn page_cache_of_the_cell_stays_under_the_limit() {
        if !root() {
            eprintln!("skipped: needs root for cgroups");
            return;
        }
        let Ok(limit) = Limit::new(32 << 20) else { return };
        // Beside the test binary (on disk: a tmpfs page cannot be reclaimed, so a file
        // there would run the cell out of memory).
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap().join(format!("pwfs-memcg-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        let knob = ["memory.peak", "memory.max_usage_in_bytes"].map(|k| limit.dir.join(k));
        let f2 = file.clone();
        limit
            .run(Duration::from_secs(120), move || {
                let chunk = vec![7u8; 1 << 20];
                let mut f = fs::File::create(&f2).map_err(|e| e.to_string())?;
                for _ in 0..96 {
                    f.write_all(&chunk).map_err(|e| e.to_string())?;
                }
                f.sync_all().map_err(|e| e.to_string())?;
                Ok(0.0)
            })
            .unwrap();
        let Some(peak) = knob.iter().find_map(|k| fs::read_to_string(k).ok()) else {
            eprintln!("skipped: this kernel keeps no peak usage (memory.peak is 5.19+)");
            return;
        };
        let peak: u64 = peak.trim().parse().unwrap();
        assert!(peak <= 32 << 20, "peak {peak}");
        assert!(peak > 1 << 20, "the cell's page cache was not charged here: peak {peak}");
        assert_eq!(fs::metadata(&file).unwrap().len(), 96 << 20);
        fs::remove_dir_all(&dir).unwrap();
    }
}
