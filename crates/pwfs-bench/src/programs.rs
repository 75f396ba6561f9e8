//! Real programs as workloads: where they run, how they are started, and how RocksDB's
//! `db_bench` is driven and read. Shared by `aios` (part (d)) and `apps`.
//!
//! Interface:
//! - `Place::fuse` mounts a fresh `Fs` over an image with FUSE and serves it from this
//!   process (`Place::fs` and `Place::shim_counters` read its engine and its shim
//!   socket); `Place::dir` is a directory on the host's file system; `Place::close`
//!   makes everything durable and unmounts. A cold start is `Place::close`, then
//!   `drop_caches`, then a new `Place` (an empty engine cache, nothing in the kernel's).
//! - `command` builds a child process, under `LD_PRELOAD` when given a library; what
//!   it prints on failure is `tail` of its output.
//! - `db_bench` runs one db_bench benchmark with `db_bench_flags` and returns its ops/s.

use pwfs::{Config, Fs};
use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `program`, its stdin from /dev/null, with `LD_PRELOAD=preload` when given.
pub fn command(program: impl AsRef<std::ffi::OsStr>, preload: Option<&Path>) -> Command {
    let mut c = Command::new(program);
    c.stdin(Stdio::null());
    if let Some(lib) = preload {
        c.env("LD_PRELOAD", lib);
    }
    c
}

/// The last lines of a failed run's output (stderr, or stdout when stderr is empty).
pub fn tail(stderr: &[u8], stdout: &[u8]) -> String {
    let text = String::from_utf8_lossy(if stderr.iter().any(|b| !b.is_ascii_whitespace()) { stderr } else { stdout });
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

/// Run `cmd` to its end; its stdout, or an error with `what`, the exit status and the
/// end of its output.
pub fn output(cmd: &mut Command, what: &str) -> R<String> {
    let out = cmd.output().map_err(err(what))?;
    if !out.status.success() {
        return Err(format!("{what}: {}:\n{}", out.status, tail(&out.stderr, &out.stdout)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The helpers the bench's C programs share (`apps/lat.h`).
const LAT_H: &str = include_str!("apps/lat.h");

/// Compile the C program `code` (its source written as `scratch/name`, with `lat.h`
/// beside it) into `scratch/exe` with `cc`, warnings as errors; `extra` goes on the
/// command line after the source (include paths, libraries).
pub fn compile_c(scratch: &Path, name: &str, code: &str, exe: &str, extra: &[OsString]) -> R<PathBuf> {
    let (src, exe) = (scratch.join(name), scratch.join(exe));
    std::fs::write(scratch.join("lat.h"), LAT_H).map_err(err("write lat.h"))?;
    std::fs::write(&src, code).map_err(err("write the C source"))?;
    output(
        command("cc", None)
            .args(["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .args(extra),
        &format!("cc {}", src.display()),
    )?;
    Ok(exe)
}

/// Write back every dirty page and drop the kernel's page, dentry and inode caches
/// (root only).
pub fn drop_caches() -> R<()> {
    // SAFETY: plain syscall.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").map_err(err("echo 3 > /proc/sys/vm/drop_caches"))
}

/// Where programs run: the root of a FUSE mount of a fresh `Fs` over an image, served
/// by threads of this process, or a directory on the host's file system.
pub struct Place {
    mount: Option<(Fs, pwfs_fuse::Mounted)>,
    /// The LD_PRELOAD shim's socket, when the mount serves it.
    shim: Option<pwfs_shim::server::Server>,
    pub dir: PathBuf,
}

impl Place {
    /// `dir` (created if missing) on the host's file system.
    pub fn dir(dir: &Path) -> R<Place> {
        std::fs::create_dir_all(dir).map_err(err("ext4 dir"))?;
        Ok(Place { mount: None, shim: None, dir: dir.to_path_buf() })
    }

    /// A fresh mount of `image` with `config`, served by FUSE at `mnt` (created, and
    /// removed again by `close`), and with `options.shim` the LD_PRELOAD shim's socket
    /// as `pwfs mount` serves it.
    pub fn fuse(image: &Path, config: Config, mnt: &Path, options: &pwfs_fuse::MountOptions) -> R<Place> {
        std::fs::create_dir_all(mnt).map_err(err("mount point"))?;
        let fs = pwfs::mount_image(image, config).map_err(err("mount"))?;
        match pwfs_fuse::mount_with(fs.clone(), mnt, options) {
            Ok(mounted) => {
                let shim = if options.shim {
                    let view = mounted.view();
                    let socket = mnt.canonicalize().map(|m| {
                        PathBuf::from(OsString::from_vec(pwfs_shim::proto::socket_path(m.as_os_str().as_bytes())))
                    });
                    let started = socket.and_then(|socket| {
                        let dev = std::fs::metadata(mnt)?.dev();
                        let server = pwfs_shim::server::Server::start(socket, fs.clone())?;
                        server.attach(dev, mnt, Box::new(move |ino| view.changed(ino)));
                        Ok(server)
                    });
                    match started {
                        Ok(s) => Some(s),
                        Err(e) => {
                            let _ = mounted.unmount();
                            let _ = fs.unmount();
                            return Err(format!("shim socket: {e}"));
                        }
                    }
                } else {
                    None
                };
                Ok(Place { mount: Some((fs, mounted)), shim, dir: mnt.to_path_buf() })
            }
            Err(e) => {
                let _ = fs.unmount();
                let _ = std::fs::remove_dir(mnt);
                Err(format!("FUSE mount: {e}"))
            }
        }
    }

    /// The engine behind a FUSE mount (its counters: `Fs::hitchhike_stats`).
    pub fn fs(&self) -> Option<&Fs> {
        self.mount.as_ref().map(|(fs, _)| fs)
    }

    /// The counters of the shim's socket, when the mount serves it.
    pub fn shim_counters(&self) -> Option<pwfs_shim::server::Counters> {
        self.shim.as_ref().map(|s| s.counters())
    }

    /// Everything durable; a FUSE mount unmounted and its mount point removed.
    pub fn close(self) -> R<()> {
        drop(self.shim);
        match self.mount {
            Some((fs, mounted)) => {
                let fuse = mounted.unmount().map_err(err("FUSE unmount"));
                let engine = fs.unmount().map_err(err("unmount"));
                let _ = std::fs::remove_dir(&self.dir);
                fuse.and(engine)
            }
            None => {
                // SAFETY: plain syscall.
                unsafe { libc::sync() };
                Ok(())
            }
        }
    }
}

/// The version of the `db_bench` on PATH ("7.8.3"), or None when there is none.
pub fn db_bench_version() -> Option<String> {
    let out = Command::new("db_bench").arg("--version").stdin(Stdio::null()).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.lines().find_map(|l| l.trim().strip_prefix("db_bench version")).map(|v| v.trim().to_string());
    Some(version.filter(|v| out.status.success() && !v.is_empty()).unwrap_or_else(|| "(version unknown)".into()))
}

/// Flags of every db_bench run: one thread, no compression, no statistics, a fixed
/// seed, every table file open from the start (its index read at open, not by the
/// lookups), a 1 MiB block cache, 4 MiB memtables flushed to SSTs and no automatic
/// compactions (the same files in every cell).
pub fn db_bench_flags(seed: u64) -> Vec<String> {
    [
        "--threads=1",
        "--compression_type=none",
        "--statistics=0",
        "--histogram=0",
        "--progress_reports=0",
        "--open_files=-1",
        "--cache_size=1048576",
        "--key_size=16",
        "--value_size=100",
        "--write_buffer_size=4194304",
        "--disable_auto_compactions=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("--seed={seed}")])
    .collect()
}

/// Run `db_bench --benchmarks=benchmark` on `db` with the common flags and `args`
/// (under `LD_PRELOAD=preload` when given), and return the benchmark's ops/s (for
/// readrandom: only if every key was found).
pub fn db_bench(db: &Path, benchmark: &str, seed: u64, args: &[String], preload: Option<&Path>) -> R<f64> {
    let what = format!("db_bench --benchmarks={benchmark} {} --db={}", args.join(" "), db.display());
    let out = output(
        command("db_bench", preload)
            .arg(format!("--db={}", db.display()))
            .arg(format!("--benchmarks={benchmark}"))
            .args(db_bench_flags(seed))
            .args(args),
        &what,
    )?;
    db_bench_ops(&out, benchmark).map_err(|e| format!("{what}: {e}"))
}

/// The ops/s of `benchmark` in db_bench's output, from its line
/// `readrandom   :      37.672 micros/op 26528 ops/sec 0.094 seconds 2500 operations;
/// 2.9 MB/s (2500 of 2500 found)`; an error if some of the keys looked up were not
/// found (a lookup of a missing key reads nothing).
pub fn db_bench_ops(out: &str, benchmark: &str) -> R<f64> {
    let rest = out
        .lines()
        .find_map(|l| l.split_once(':').filter(|(name, _)| name.trim() == benchmark).map(|(_, rest)| rest))
        .ok_or_else(|| format!("no `{benchmark} :` line in its output"))?;
    let words: Vec<&str> = rest.split_whitespace().collect();
    let ops = words
        .iter()
        .position(|w| w.starts_with("ops/sec"))
        .and_then(|i| words.get(i.checked_sub(1)?))
        .and_then(|w| w.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .ok_or_else(|| format!("no ops/sec figure in {rest:?}"))?;
    if let Some((_, found)) = rest.rsplit_once('(').filter(|(_, f)| f.contains("found")) {
        let n: Vec<&str> = found.split_whitespace().collect();
        if n.len() < 3 || n[1] != "of" || n[0] != n[2] {
            return Err(format!("not every key was found: ({found}"));
        }
    }
    Ok(ops)
}

/// The bytes of a RocksDB database's SST files.
pub fn sst_bytes(db: &Path) -> u64 {
    let Ok(dir) = std::fs::read_dir(db) else { return 0 };
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// db_bench's result lines (RocksDB 7.8.3), parsed without db_bench.
    #[test]
    fn parses_db_bench_output() {
        let out = "DB path: [/tmp/db]\n\
                   fillsync     :    3372.057 micros/op 296 ops/sec 6.744 seconds 2000 operations;    0.0 MB/s (2 ops)\n\
                   readrandom   :      37.672 micros/op 26528 ops/sec 0.094 seconds 2500 operations;    2.9 MB/s \
                   (2500 of 2500 found)\n";
        assert_eq!(db_bench_ops(out, "fillsync"), Ok(296.0));
        assert_eq!(db_bench_ops(out, "readrandom"), Ok(26528.0));
        assert!(db_bench_ops(out, "fillseq").is_err());
        let missing = "readrandom   :      3.0 micros/op 333333 ops/sec; (12 of 2500 found)\n";
        assert!(db_bench_ops(missing, "readrandom").unwrap_err().contains("not every key"));
        assert!(db_bench_ops("readrandom : nothing here\n", "readrandom").is_err());
        assert_eq!(tail(b"", b"a\n\nb\n"), "a\nb");
    }
}
