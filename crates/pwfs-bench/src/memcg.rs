//! Running one cell of a bench under a memory limit: a child process in a memory
//! cgroup of its own, so that the kernel's page cache it fills is bounded like
//! pwfs's own cache is (`Config::cache_bytes`).
//!
//! The child is a fork of the bench (no exec): it moves itself into the cgroup, runs
//! the cell (threads and `std::fs` calls only; it never touches an `Fs` of the
//! parent, whose threads do not exist in the child) and sends its figure back over a
//! pipe. Page-cache pages are charged to the cgroup of the process whose access
//! brings them in, so the child's reads and writes — of ext4 files, or of a FUSE
//! mount's files in the kernel's cache — count against the limit, and the parent's
//! do not. Both cgroup versions work: v2 (`memory.max`, where the unified hierarchy
//! has the memory controller) and v1 (`memory.limit_in_bytes`).

use std::fs;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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
    pub fn run(&self, cell: impl FnOnce() -> Result<f64, String>) -> Result<f64, String> {
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
        let mut answer = String::new();
        let read = input.read_to_string(&mut answer);
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
        read.map_err(|e| format!("reading the cell's answer: {e}"))?;
        match answer.split_once(' ') {
            Some(("ok", v)) => v.parse().map_err(|e| format!("cell answered {answer:?}: {e}")),
            Some(("err", e)) => Err(e.to_string()),
            _ => Err(format!("cell answered {answer:?} (status {status})")),
        }
    }
}

impl Drop for Limit {
    fn drop(&mut self) {
        // The children are gone; their page cache may still be charged here, which an
        // rmdir of a cgroup allows (the charges move to the parent).
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
        let v = limit
            .run(|| {
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
        let e = limit.run(|| Err("no luck".into())).unwrap_err();
        assert_eq!(e, "no luck");
        let e = limit.run(|| panic!("boom")).unwrap_err();
        assert!(e.contains("panicked"), "{e}");
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
            .run(move || {
                let chunk = vec![7u8; 1 << 20];
                let mut f = fs::File::create(&f2).map_err(|e| e.to_string())?;
                for _ in 0..96 {
                    f.write_all(&chunk).map_err(|e| e.to_string())?;
                }
                f.sync_all().map_err(|e| e.to_string())?;
                Ok(0.0)
            })
            .unwrap();
        let peak: u64 = knob.iter().find_map(|k| fs::read_to_string(k).ok()).unwrap().trim().parse().unwrap();
        assert!(peak <= 32 << 20, "peak {peak}");
        assert!(peak > 1 << 20, "the cell's page cache was not charged here: peak {peak}");
        assert_eq!(fs::metadata(&file).unwrap().len(), 96 << 20);
        fs::remove_dir_all(&dir).unwrap();
    }
}
