//! `pwfs bench apps`: unmodified programs on the host's ext4, on a pwfs FUSE mount, and
//! on the same kind of mount with the programs under the LD_PRELOAD shim, in one run
//! (issue 12).
//!
//! Columns:
//! - `ext4`: a directory on the host's file system beside the image (the same disk);
//! - `fuse`: a FUSE mount of a fresh image with the defaults of `pwfs mount` (kernel
//!   cache write-through, a 256 MiB engine cache, noatime), served by this process;
//! - `shim`: the same mount, every program run with `LD_PRELOAD=libpwfs_preload.so`
//!   (`cargo build --release -p pwfs-preload`; found through `$PWFS_PRELOAD` or beside
//!   the running `pwfs`). Without it the column is left out and the report says why;
//! - `capi` (latency rows only): the engine inside a C program, through `libpwfs.so`
//!   (`$PWFS_CAPI` or beside `pwfs`).
//!
//! Parts (`--only db_bench,sqlite,fio,pread`), each a child process per cell:
//! - `db_bench`: RocksDB's db_bench (rocksdb-tools) `fillsync`, `fillrandom`, `fillseq`,
//!   then `readrandom` cold over the fillseq database: the place closed (a FUSE mount
//!   unmounted, ext4 synced), the kernel's caches dropped, a fresh mount; ops/s;
//! - `sqlite`: the `sqlite3` shell running N transactions of one INSERT each
//!   (synchronous=FULL), journal_mode DELETE and WAL; transactions/s of the process's
//!   wall time;
//! - `fio`: psync 4 KiB random reads, cold (after the same cold start) and cached (after
//!   one sequential pass in the same fio process), and 4 KiB random overwrites each
//!   followed by fdatasync; ops/s as 1 / the mean time of one operation;
//! - `pread`: `pread_lat.c` (compiled here with `cc`): the time of one cached 4 KiB
//!   pread at random offsets, p50 and mean, ns; `capi_lat.c` does the same through the
//!   C ABI on an image of its own beside the ext4 directory.
//!
//! Every part visits the columns once per round, the order rotating from one round
//! (and part) to the next, so that the drift of this shared machine falls on all of
//! them; figures are medians over the rounds. Needs root and /dev/fuse for `fuse` and
//! `shim` (without them only `ext4`, and `capi`, run); a missing program leaves its part
//! out with a note saying how to install it.

use crate::basic::make_image;
use crate::programs::{command, db_bench, db_bench_flags, db_bench_version, drop_caches, output, Place};
use crate::{median, Opts, Report};
use serde_json::Value;
use std::collections::HashMap;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

const MIB: u64 = 1 << 20;

/// The parts `--only` takes.
pub const PARTS: [&str; 4] = ["db_bench", "sqlite", "fio", "pread"];

/// The C programs of part `pread`, and the header of the C ABI they are built against.
const PREAD_LAT_C: &str = include_str!("apps/pread_lat.c");
const CAPI_LAT_C: &str = include_str!("apps/capi_lat.c");
const PWFS_H: &str = include_str!("../../pwfs-capi/include/pwfs.h");

/// The shim and the C ABI library: the environment variable that names one, and its
/// file name beside the running executable.
pub(crate) const PRELOAD_ENV: &str = "PWFS_PRELOAD";
pub(crate) const PRELOAD_LIB: &str = "libpwfs_preload.so";
const CAPI_ENV: &str = "PWFS_CAPI";
const CAPI_LIB: &str = "libpwfs.so";

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Col {
    Ext4,
    Fuse,
    Shim,
    Capi,
}

impl Col {
    fn name(self) -> &'static str {
        match self {
            Col::Ext4 => "ext4",
            Col::Fuse => "fuse",
            Col::Shim => "shim",
            Col::Capi => "capi",
        }
    }
}

/// How much each part does per cell.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// db_bench: fillsync writes, fillseq and fillrandom keys (16 B keys, 100 B
    /// values), cold readrandom lookups.
    syncs: usize,
    fill: usize,
    reads: usize,
    /// sqlite3: transactions per journal mode.
    txns: usize,
    /// fio: the file, cold reads, overwrite+fdatasync pairs, the cached reads' time.
    fio_mib: u64,
    cold: usize,
    fdatasyncs: usize,
    cached_ms: u64,
    /// pread: the file (and the C ABI's), timed preads.
    pread_mib: u64,
    preads: usize,
}

impl Sizes {
    /// Smoke: seconds. Quick: a few minutes with three columns and three rounds. Full:
    /// the fills as in `bench aios` part (d) (110 MiB of SSTs, more than the engine's
    /// cache); the cold reads well under the fio file's pages, so that each reads a
    /// page no earlier one did.
    fn of(o: &Opts) -> Sizes {
        match o.ops {
            n if n <= 100 => Sizes {
                syncs: 20,
                fill: 2000,
                reads: 200,
                txns: 20,
                fio_mib: 8,
                cold: 100,
                fdatasyncs: 20,
                cached_ms: 200,
                pread_mib: 4,
                preads: 10_000,
            },
            n if n <= 2000 => Sizes {
                syncs: 300,
                fill: 200_000,
                reads: 4000,
                txns: 300,
                fio_mib: 64,
                cold: 2000,
                fdatasyncs: 300,
                cached_ms: 1000,
                pread_mib: 16,
                preads: 200_000,
            },
            _ => Sizes {
                syncs: 2000,
                fill: 1_000_000,
                reads: 8000,
                txns: 2000,
                fio_mib: 128,
                cold: 4000,
                fdatasyncs: 2000,
                cached_ms: 3000,
                pread_mib: 64,
                preads: 1_000_000,
            },
        }
    }

    /// Room on the image for the largest cell (a database, the fio and pread files).
    fn image_bytes(self) -> u64 {
        (self.fill as u64 * 512).div_ceil(MIB) * MIB + (self.fio_mib + self.pread_mib + 128) * MIB
    }
}

/// Where the columns run.
struct Bench {
    image: PathBuf,
    mnt: PathBuf,
    kdir: PathBuf,
    /// Scratch files on the host: the C programs, the SQL script, the C ABI's image.
    scratch: PathBuf,
    /// The shim, found and seen loaded by a program.
    preload: Option<PathBuf>,
    /// Caches are dropped with /proc/sys/vm/drop_caches (root), or else file by file in
    /// the ext4 directory (POSIX_FADV_DONTNEED; there is no FUSE column then).
    root: bool,
    seed: u64,
}

impl Bench {
    fn place(&self, col: Col) -> R<Place> {
        match col {
            Col::Ext4 => Place::dir(&self.kdir),
            Col::Fuse | Col::Shim => {
                let source = self.image.canonicalize().unwrap_or_else(|_| self.image.clone());
                // As `pwfs mount` mounts by default: the image as the source, noatime, the
                // shim served (both columns: the fuse column's programs just do not use it).
                let options = pwfs_fuse::MountOptions {
                    fsname: Some(source.to_string_lossy().into_owned()),
                    flags: libc::MS_NOATIME,
                    shim: true,
                    ..Default::default()
                };
                Place::fuse(&self.image, pwfs::Config::default(), &self.mnt, &options)
            }
            Col::Capi => Err("capi runs on an image of its own".into()),
        }
    }

    fn preload(&self, col: Col) -> Option<&Path> {
        if col == Col::Shim {
            self.preload.as_deref()
        } else {
            None
        }
    }

    fn drop_caches(&self) -> R<()> {
        if self.root {
            drop_caches()
        } else {
            evict_tree(&self.kdir);
            Ok(())
        }
    }

    /// A cold start: `place` closed, the kernel's caches dropped, a new place.
    fn cold(&self, place: Place, col: Col) -> R<Place> {
        place.close()?;
        self.drop_caches()?;
        self.place(col)
    }
}

/// Drop the kernel's cached pages of every file under `dir`.
fn evict_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => evict_tree(&path),
            Ok(t) if t.is_file() => {
                if let Ok(f) = std::fs::File::open(&path) {
                    // SAFETY: plain syscalls on an fd we own.
                    unsafe {
                        libc::fdatasync(f.as_raw_fd());
                        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
                    }
                }
            }
            _ => {}
        }
    }
}

/// A file of `mib` MiB of non-zero bytes, written in 1 MiB pieces and fsynced.
fn write_file(path: &Path, mib: u64) -> R<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(err("create"))?;
    let chunk = vec![0x5au8; MIB as usize];
    for _ in 0..mib {
        f.write_all(&chunk).map_err(err("write"))?;
    }
    f.sync_all().map_err(err("fsync"))
}

/// The library named by `$var`, or `file` beside the running executable (or one
/// directory up, when that is a test's `deps/`); why not otherwise.
pub(crate) fn locate(var: &str, file: &str, build: &str) -> R<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("{var}={}: no such file", p.display())) };
    }
    let exe = std::env::current_exe().map_err(err("current_exe"))?;
    let dir = exe.parent().ok_or("the executable has no directory")?;
    let mut candidates = vec![dir.join(file)];
    if dir.file_name().is_some_and(|n| n == "deps") {
        candidates.extend(dir.parent().map(|d| d.join(file)));
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| format!("no {file} beside {} and no ${var} ({build})", exe.display()))
}

/// The shim, if a program run under it has it mapped (ld.so only warns, and runs the
/// program without it, when a preloaded library cannot be loaded).
pub(crate) fn probe_preload(lib: &Path) -> R<PathBuf> {
    let lib = lib.canonicalize().map_err(err("canonicalize"))?;
    let out = command("cat", Some(&lib)).arg("/proc/self/maps").output().map_err(err("cat /proc/self/maps"))?;
    let maps = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && maps.contains(&*lib.to_string_lossy()) {
        Ok(lib)
    } else {
        Err(format!(
            "LD_PRELOAD={} does not load ({}): {}",
            lib.display(),
            out.status,
            crate::programs::tail(&out.stderr, b"")
        ))
    }
}

/// The first line a program prints for `--version` (`sqlite3 --version`,
/// `fio --version`, `cc --version`), or None when it cannot be run.
fn version(program: &str) -> Option<String> {
    let out = command(program, None).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap_or("").trim().to_string();
    out.status.success().then_some(first)
}

/// What the host's file system under `dir` is (the `ext4` column's name assumes it).
fn fs_type(dir: &Path) -> String {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return "unknown".into() };
    // SAFETY: an all-zero statfs is a valid value; statfs fills it in.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a struct of the right type.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown".into();
    }
    match st.f_type as i64 {
        0xef53 => "ext2/3/4".into(),
        0x0102_1994 => "tmpfs".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683e => "btrfs".into(),
        0x794c_7630 => "overlayfs".into(),
        t => format!("type {t:#x}"),
    }
}

// ---------------------------------------------------------------------------------
// db_bench

/// Part `db_bench`'s figures of one column, over the rounds (ops/s).
#[derive(Default)]
struct DbAcc {
    fillsync: Vec<f64>,
    fillrandom: Vec<f64>,
    fillseq: Vec<f64>,
    cold: Vec<f64>,
}

/// One cell of part `db_bench`: fillsync, fillrandom and fillseq on a fresh place (each
/// a fresh database; the first two removed after), then readrandom over the fillseq
/// database after a cold start. The databases are gone afterwards.
fn db_bench_cell(b: &Bench, col: Col, s: Sizes, acc: &mut DbAcc) -> R<()> {
    let pre = b.preload(col);
    let num = |n: usize| format!("--num={n}");
    b.drop_caches()?;
    let place = b.place(col)?;
    let (db, db_sync, db_random) = (place.dir.join("db"), place.dir.join("db-sync"), place.dir.join("db-random"));
    let mut fill = || -> R<()> {
        acc.fillsync.push(db_bench(&db_sync, "fillsync", b.seed, &[num(s.syncs)], pre)?);
        std::fs::remove_dir_all(&db_sync).map_err(err("remove the fillsync db"))?;
        acc.fillrandom.push(db_bench(&db_random, "fillrandom", b.seed, &[num(s.fill)], pre)?);
        std::fs::remove_dir_all(&db_random).map_err(err("remove the fillrandom db"))?;
        acc.fillseq.push(db_bench(&db, "fillseq", b.seed, &[num(s.fill)], pre)?);
        Ok(())
    };
    let filled = fill();
    if filled.is_err() {
        for d in [&db_sync, &db_random, &db] {
            let _ = std::fs::remove_dir_all(d);
        }
        let _ = place.close();
        return filled;
    }
    let place = b.cold(place, col)?;
    let read = [num(s.fill), format!("--reads={}", s.reads), "--use_existing_db=1".into()];
    let cold = db_bench(&db, "readrandom", b.seed, &read, pre);
    let removed = std::fs::remove_dir_all(&db).map_err(err("remove the db"));
    let closed = place.close();
    acc.cold.push(cold?);
    removed?;
    closed
}

// ---------------------------------------------------------------------------------
// sqlite3

const JOURNAL_MODES: [&str; 2] = ["DELETE", "WAL"];

/// The timed script: synchronous=FULL, then `txns` transactions of one INSERT of a
/// 100-byte value each.
fn sqlite_script(txns: usize) -> String {
    let mut s = String::from("PRAGMA synchronous=FULL;\n");
    for i in 0..txns {
        s += &format!("BEGIN; INSERT INTO t(v) VALUES('{i:0100}'); COMMIT;\n");
    }
    s
}

/// Run `sqlite3 -bail DB` with `stdin` as its input.
fn sqlite3(db: &Path, stdin: std::process::Stdio, preload: Option<&Path>) -> R<()> {
    let what = format!("sqlite3 {}", db.display());
    output(command("sqlite3", preload).arg("-bail").arg(db).stdin(stdin), &what).map(|_| ())
}

/// One cell of part `sqlite`: in each journal mode, a fresh database and table made by
/// one sqlite3 process (untimed), then the script run by another, timed from its start
/// to its exit; transactions/s. The databases are gone afterwards.
fn sqlite_cell(b: &Bench, col: Col, s: Sizes, script: &Path, acc: &mut [Vec<f64>; 2]) -> R<()> {
    let pre = b.preload(col);
    let place = b.place(col)?;
    let mut run = || -> R<()> {
        for (mode, out) in JOURNAL_MODES.iter().zip(acc.iter_mut()) {
            let db = place.dir.join(format!("sqlite-{}.db", mode.to_lowercase()));
            let setup = format!("PRAGMA journal_mode={mode}; CREATE TABLE t(k INTEGER PRIMARY KEY, v TEXT);");
            output(command("sqlite3", pre).arg("-bail").arg(&db).arg(setup), "sqlite3 (setup)")?;
            let input = std::fs::File::open(script).map_err(err("the SQL script"))?;
            let t = Instant::now();
            let timed = sqlite3(&db, input.into(), pre);
            let secs = t.elapsed().as_secs_f64();
            for suffix in ["", "-journal", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
            }
            timed?;
            out.push(s.txns as f64 / secs);
        }
        Ok(())
    };
    let ran = run();
    let closed = place.close();
    ran.and(closed)
}

// ---------------------------------------------------------------------------------
// fio

/// Part `fio`'s figures of one column, over the rounds.
#[derive(Default)]
struct FioAcc {
    cold: Vec<f64>,
    cold_p50_us: Vec<f64>,
    cached: Vec<f64>,
    fdatasync: Vec<f64>,
    fdatasync_p50_us: Vec<f64>,
}

/// One job's figures from fio's JSON output.
#[derive(Debug, Clone, Copy, PartialEq)]
struct FioJob {
    /// 1 / the mean time of one operation (the write's and, when there is one, the
    /// fdatasync's after it).
    ops: f64,
    /// Completion latency p50 of the reads or writes, us.
    p50_us: f64,
    /// The fdatasync calls' latency p50, us.
    sync_p50_us: Option<f64>,
}

/// The figures of job `name`'s `rw` side ("read" or "write") in fio's
/// `--output-format=json` output. (fio's own iops divides by a runtime in whole
/// milliseconds, too coarse for short cells.)
fn fio_job(out: &str, name: &str, rw: &str) -> R<FioJob> {
    let json = out.find('{').map(|i| &out[i..]).ok_or("no JSON in fio's output")?;
    let v: Value = serde_json::from_str(json).map_err(err("fio's JSON"))?;
    let job = v["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["jobname"] == name))
        .ok_or_else(|| format!("no job {name:?} in fio's JSON"))?;
    let side = &job[rw];
    let n = side["total_ios"].as_f64().filter(|n| *n > 0.0).ok_or_else(|| format!("job {name}: no {rw}s"))?;
    let mean = side["lat_ns"]["mean"].as_f64().ok_or_else(|| format!("job {name}: no {rw} lat_ns"))?;
    let p50 = |v: &Value| v["percentile"]["50.000000"].as_f64().map(|ns| ns / 1e3);
    let sync = &job["sync"]["lat_ns"];
    let syncs = sync["N"].as_f64().unwrap_or(0.0);
    let sync_ns = if syncs > 0.0 { sync["mean"].as_f64().unwrap_or(0.0) * syncs } else { 0.0 };
    let per_op = (mean * n + sync_ns) / n;
    Ok(FioJob {
        ops: 1e9 / per_op,
        p50_us: p50(&side["clat_ns"]).ok_or_else(|| format!("job {name}: no clat percentiles"))?,
        sync_p50_us: if syncs > 0.0 { p50(sync) } else { None },
    })
}

/// Flags of every fio run: one process (jobs as threads), psync, 4 KiB, the file.
fn fio_flags(file: &Path, s: Sizes, seed: u64) -> Vec<String> {
    vec![
        "--thread".into(),
        "--output-format=json".into(),
        "--ioengine=psync".into(),
        format!("--filename={}", file.display()),
        format!("--size={}M", s.fio_mib),
        format!("--randseed={seed}"),
    ]
}

/// The three jobs: cold random reads (each page at most once: fio's random map), a
/// sequential pass and then cached random reads for a fixed time, random overwrites
/// each followed by fdatasync.
fn fio_jobs(s: Sizes) -> [(&'static str, Vec<String>); 3] {
    let v = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    [
        ("cold", [v(&["--name=cold", "--rw=randread", "--bs=4k"]), vec![format!("--number_ios={}", s.cold)]].concat()),
        (
            "cached",
            [
                v(&["--invalidate=0", "--name=warm", "--rw=read", "--bs=1M"]),
                v(&["--name=cached", "--stonewall", "--rw=randread", "--bs=4k", "--norandommap", "--time_based"]),
                vec![format!("--runtime={}ms", s.cached_ms)],
            ]
            .concat(),
        ),
        (
            "fdatasync",
            [
                v(&["--invalidate=0", "--name=fdatasync", "--rw=randwrite", "--bs=4k", "--fdatasync=1"]),
                vec![format!("--number_ios={}", s.fdatasyncs)],
            ]
            .concat(),
        ),
    ]
}

fn fio(file: &Path, s: Sizes, seed: u64, job: &[String], preload: Option<&Path>) -> R<String> {
    let what = format!("fio {}", job.join(" "));
    output(command("fio", preload).args(fio_flags(file, s, seed)).args(job), &what)
}

/// One cell of part `fio`: the file written on a fresh place and closed; after a cold
/// start the cold reads, then the cached reads and the overwrites, each its own fio
/// process. The file is gone afterwards.
fn fio_cell(b: &Bench, col: Col, s: Sizes, acc: &mut FioAcc) -> R<()> {
    let pre = b.preload(col);
    b.drop_caches()?;
    let place = b.place(col)?;
    let file = place.dir.join("fio.dat");
    if let Err(e) = write_file(&file, s.fio_mib) {
        let _ = std::fs::remove_file(&file);
        let _ = place.close();
        return Err(e);
    }
    let place = b.cold(place, col)?;
    let [cold, cached, fdatasync] = fio_jobs(s);
    let mut run = || -> R<()> {
        let out = fio(&file, s, b.seed, &cold.1, pre)?;
        let j = fio_job(&out, cold.0, "read")?;
        acc.cold.push(j.ops);
        acc.cold_p50_us.push(j.p50_us);
        let out = fio(&file, s, b.seed, &cached.1, pre)?;
        acc.cached.push(fio_job(&out, cached.0, "read")?.ops);
        let out = fio(&file, s, b.seed, &fdatasync.1, pre)?;
        let j = fio_job(&out, fdatasync.0, "write")?;
        acc.fdatasync.push(j.ops);
        acc.fdatasync_p50_us.push(j.sync_p50_us.ok_or("fio reported no fdatasync latency")?);
        Ok(())
    };
    let ran = run();
    let removed = std::fs::remove_file(&file).map_err(err("remove the fio file"));
    let closed = place.close();
    ran.and(removed).and(closed)
}

// ---------------------------------------------------------------------------------
// pread

/// Part `pread`'s figures of one column, over the rounds (ns).
#[derive(Default)]
struct PreadAcc {
    p50: Vec<f64>,
    mean: Vec<f64>,
}

/// `p50_ns=P mean_ns=M n=N` → (P, M).
fn parse_lat(out: &str) -> R<(f64, f64)> {
    let field = |key: &str| {
        out.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    match (field("p50_ns="), field("mean_ns=")) {
        (Some(p), Some(m)) => Ok((p, m)),
        _ => Err(format!("no p50_ns=/mean_ns= in {out:?}")),
    }
}

/// The C programs, compiled into `scratch`: pread_lat, and capi_lat when the C ABI's
/// library is there.
struct Programs {
    pread_lat: PathBuf,
    capi_lat: Option<PathBuf>,
}

fn compile(scratch: &Path, capi: Option<&Path>) -> R<Programs> {
    std::fs::create_dir_all(scratch).map_err(err("scratch dir"))?;
    let cc = |src: &str, code: &str, exe: &str, extra: &[std::ffi::OsString]| {
        crate::programs::compile_c(scratch, src, code, exe, extra)
    };
    let pread_lat = cc("pread_lat.c", PREAD_LAT_C, "pread_lat", &[])?;
    let capi_lat = match capi {
        Some(lib) => {
            std::fs::write(scratch.join("pwfs.h"), PWFS_H).map_err(err("write pwfs.h"))?;
            let dir = lib.parent().ok_or("the C ABI library has no directory")?;
            let extra: Vec<std::ffi::OsString> = vec![
                "-I".into(),
                scratch.into(),
                lib.into(),
                format!("-Wl,-rpath,{}", dir.display()).into(),
                "-lpthread".into(),
            ];
            Some(cc("capi_lat.c", CAPI_LAT_C, "capi_lat", &extra)?)
        }
        None => None,
    };
    Ok(Programs { pread_lat, capi_lat })
}

/// One cell of part `pread`: a file written on a fresh place and timed by pread_lat
/// (under the shim for its column), or capi_lat on an image of its own. The file (the
/// image) is gone afterwards.
fn pread_cell(b: &Bench, col: Col, s: Sizes, p: &Programs, acc: &mut PreadAcc) -> R<()> {
    let (n, seed) = (s.preads.to_string(), b.seed.to_string());
    let out = if col == Col::Capi {
        let exe = p.capi_lat.as_ref().ok_or("capi_lat was not built")?;
        let image = b.scratch.join("capi.img");
        let out = output(
            command(exe, None).arg(&image).arg(s.pread_mib.to_string()).arg(&n).arg(&seed),
            &format!("{} {}", exe.display(), image.display()),
        );
        let _ = std::fs::remove_file(&image);
        out?
    } else {
        let place = b.place(col)?;
        let file = place.dir.join("pread.dat");
        let out = write_file(&file, s.pread_mib).and_then(|_| {
            output(
                command(&p.pread_lat, b.preload(col)).arg(&file).arg(&n).arg(&seed),
                &format!("pread_lat {}", file.display()),
            )
        });
        let removed = std::fs::remove_file(&file).map_err(err("remove the pread file"));
        let closed = place.close();
        let out = out?;
        removed?;
        closed?;
        out
    };
    let (p50, mean) = parse_lat(&out)?;
    acc.p50.push(p50);
    acc.mean.push(mean);
    Ok(())
}

// ---------------------------------------------------------------------------------

/// The figures of every part, by column.
#[derive(Default)]
struct Acc {
    db: HashMap<Col, DbAcc>,
    sqlite: HashMap<Col, [Vec<f64>; 2]>,
    fio: HashMap<Col, FioAcc>,
    pread: HashMap<Col, PreadAcc>,
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    for part in &o.only {
        if !PARTS.contains(&part.as_str()) {
            return Err(format!("unknown part {part:?} of bench apps (known: {})", PARTS.join(", ")));
        }
    }
    let wanted = |p: &str| o.only.is_empty() || o.only.iter().any(|x| x == p);
    let s = Sizes::of(o);
    let mut notes = Vec::new();

    // The programs each part needs; a part without them is left out, and says so.
    let db_version = if wanted("db_bench") { db_bench_version() } else { None };
    let sqlite_version = if wanted("sqlite") { version("sqlite3") } else { None };
    let fio_version = if wanted("fio") { version("fio") } else { None };
    let cc_version = if wanted("pread") { version("cc") } else { None };
    for (part, found, install) in [
        ("db_bench", db_version.is_some(), "db_bench not found (apt-get install rocksdb-tools)"),
        ("sqlite", sqlite_version.is_some(), "sqlite3 not found (apt-get install sqlite3)"),
        ("fio", fio_version.is_some(), "fio not found (apt-get install fio)"),
        ("pread", cc_version.is_some(), "no C compiler `cc` (apt-get install gcc)"),
    ] {
        if wanted(part) && !found {
            notes.push(format!("{part} skipped: {install}"));
        }
    }

    // The columns.
    let fuse = pwfs_fuse::can_mount();
    let mut cols = vec![Col::Ext4];
    let mut preload = None;
    if fuse {
        cols.push(Col::Fuse);
        match locate(PRELOAD_ENV, PRELOAD_LIB, "cargo build --release -p pwfs-preload").and_then(|l| probe_preload(&l))
        {
            Ok(lib) => {
                notes.push(format!("shim: LD_PRELOAD={}", lib.display()));
                preload = Some(lib);
                cols.push(Col::Shim);
            }
            Err(why) => notes.push(format!("shim column skipped: {why}")),
        }
    } else {
        notes.push("fuse and shim columns skipped: a FUSE mount needs root and /dev/fuse".into());
    }
    let capi = if cc_version.is_some() {
        match locate(CAPI_ENV, CAPI_LIB, "cargo build --release -p pwfs-capi") {
            Ok(lib) => {
                notes.push(format!("capi: {} (pread rows only)", lib.display()));
                Some(lib)
            }
            Err(why) => {
                notes.push(format!("capi column skipped: {why}"));
                None
            }
        }
    } else {
        None
    };

    std::fs::create_dir_all(&o.dir).map_err(err("bench dir"))?;
    let device = crate::DeviceProbe::measure(&o.dir);
    let b = Bench {
        image: o.dir.join("apps.img"),
        mnt: o.dir.join("apps-mnt"),
        kdir: o.dir.join("apps-ext4"),
        scratch: o.dir.join("apps-scratch"),
        preload,
        // SAFETY: plain syscall.
        root: unsafe { libc::geteuid() } == 0,
        seed: o.seed,
    };
    let _ = std::fs::remove_dir_all(&b.kdir);
    let _ = std::fs::remove_dir_all(&b.scratch);
    std::fs::create_dir_all(&b.kdir).map_err(err("ext4 dir"))?;
    std::fs::create_dir_all(&b.scratch).map_err(err("scratch dir"))?;
    let host_fs = fs_type(&b.kdir);

    let mut acc = Acc::default();
    let result = (|| -> R<()> {
        if fuse {
            progress("making the image");
            make_image(&b.image, s.image_bytes())?;
        }
        let programs = match cc_version {
            Some(_) => Some(compile(&b.scratch, capi.as_deref())?),
            None => None,
        };
        let script = b.scratch.join("inserts.sql");
        if sqlite_version.is_some() {
            std::fs::write(&script, sqlite_script(s.txns)).map_err(err("the SQL script"))?;
        }
        let mut pread_cols = cols.clone();
        if programs.as_ref().is_some_and(|p| p.capi_lat.is_some()) {
            pread_cols.push(Col::Capi);
        }
        let rounds = o.runs.max(1);
        for round in 0..rounds {
            let turn = |part: usize, cols: &[Col]| {
                let mut c = cols.to_vec();
                let n = c.len();
                c.rotate_left((round + part) % n);
                c
            };
            let at = |what: &str, col: Col| format!("round {} of {rounds}: {what} on {}", round + 1, col.name());
            if db_version.is_some() {
                for col in turn(0, &cols) {
                    progress(&at("db_bench", col));
                    let a = acc.db.entry(col).or_default();
                    db_bench_cell(&b, col, s, a).map_err(|e| format!("db_bench on {}: {e}", col.name()))?;
                }
            }
            if sqlite_version.is_some() {
                for col in turn(1, &cols) {
                    progress(&at("sqlite3", col));
                    let a = acc.sqlite.entry(col).or_default();
                    sqlite_cell(&b, col, s, &script, a).map_err(|e| format!("sqlite3 on {}: {e}", col.name()))?;
                }
            }
            if fio_version.is_some() {
                for col in turn(2, &cols) {
                    progress(&at("fio", col));
                    let a = acc.fio.entry(col).or_default();
                    fio_cell(&b, col, s, a).map_err(|e| format!("fio on {}: {e}", col.name()))?;
                }
            }
            if let Some(p) = &programs {
                for col in turn(3, &pread_cols) {
                    progress(&at("cached 4 KiB pread", col));
                    let a = acc.pread.entry(col).or_default();
                    pread_cell(&b, col, s, p, a).map_err(|e| format!("pread on {}: {e}", col.name()))?;
                }
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&b.image);
    let _ = std::fs::remove_dir(&b.mnt);
    let _ = std::fs::remove_dir_all(&b.kdir);
    let _ = std::fs::remove_dir_all(&b.scratch);
    result?;

    let mut columns = cols.clone();
    if acc.pread.contains_key(&Col::Capi) {
        columns.push(Col::Capi);
    }
    let mut r = Report {
        title: format!(
            "pwfs bench apps: programs on ext4, a pwfs FUSE mount (fuse) and that mount under the LD_PRELOAD shim \
             (shim); columns {}; {} round(s), columns rotated",
            columns.iter().map(|c| c.name()).collect::<Vec<_>>().join(", "),
            o.runs.max(1)
        ),
        columns: columns.iter().map(|c| c.name().to_string()).collect(),
        ratio_bases: if fuse { vec!["fuse".into(), "ext4".into()] } else { vec!["ext4".into()] },
        device: Some(device),
        notes,
        ..Default::default()
    };
    fn cells<T>(m: &HashMap<Col, T>, get: impl Fn(&T) -> &Vec<f64>) -> Vec<(&'static str, f64)> {
        let mut v: Vec<(Col, f64)> = m.iter().map(|(c, a)| (*c, median(get(a).clone()))).collect();
        v.sort_by_key(|(c, _)| *c as u8);
        v.into_iter().map(|(c, x)| (c.name(), x)).collect()
    }
    if let Some(version) = &db_version {
        type Figure = fn(&DbAcc) -> &Vec<f64>;
        let rows: [(&str, Figure); 4] = [
            ("fillseq", |a| &a.fillseq),
            ("fillrandom", |a| &a.fillrandom),
            ("fillsync", |a| &a.fillsync),
            ("readrandom cold", |a| &a.cold),
        ];
        for (what, get) in rows {
            r.row(&format!("db_bench {what}"), "ops/s", false, &cells(&acc.db, get));
        }
        r.notes.push(format!(
            "db_bench {version}: per cell fillsync --num={} (writes with sync=1), fillrandom --num={} and fillseq \
             --num={}, each a fresh database; then the place closed (FUSE unmounted; ext4 synced), the kernel's \
             caches dropped, a fresh mount, and readrandom --reads={} --use_existing_db=1 over the fillseq \
             database; common flags: {}",
            s.syncs,
            s.fill,
            s.fill,
            s.reads,
            db_bench_flags(o.seed).join(" ")
        ));
    }
    if let Some(version) = &sqlite_version {
        for (i, mode) in JOURNAL_MODES.iter().enumerate() {
            r.row(&format!("sqlite3 1 insert/txn, {mode}"), "txn/s", false, &cells(&acc.sqlite, |a| &a[i]));
        }
        r.notes.push(format!(
            "sqlite3 {}: per journal mode a fresh database (`PRAGMA journal_mode=MODE; CREATE TABLE t(k INTEGER \
             PRIMARY KEY, v TEXT)`), then `sqlite3 -bail DB < script`, timed from start to exit: PRAGMA \
             synchronous=FULL and {} lines `BEGIN; INSERT INTO t(v) VALUES('<100 digits>'); COMMIT;`",
            version.split_whitespace().next().unwrap_or("?"),
            s.txns
        ));
    }
    if let Some(version) = &fio_version {
        r.row("fio 4K randread cold", "ops/s", false, &cells(&acc.fio, |a| &a.cold));
        r.row("fio 4K randread cold p50", "us", true, &cells(&acc.fio, |a| &a.cold_p50_us));
        r.row("fio 4K randread cached", "ops/s", false, &cells(&acc.fio, |a| &a.cached));
        r.row("fio 4K randwrite+fdatasync", "ops/s", false, &cells(&acc.fio, |a| &a.fdatasync));
        r.row("fio fdatasync p50", "us", true, &cells(&acc.fio, |a| &a.fdatasync_p50_us));
        let [cold, cached, fdatasync] = fio_jobs(s);
        let flags = fio_flags(Path::new("FILE"), s, o.seed).join(" ");
        r.notes.push(format!(
            "{version}: `fio {flags}` and, one process each, cold: `{}` (after the file was written, the place \
             closed, the kernel's caches dropped, a fresh mount), cached: `{}`, fdatasync: `{}`; ops/s = 1 / the \
             mean time of one read (of one write and the fdatasync after it)",
            cold.1.join(" "),
            cached.1.join(" "),
            fdatasync.1.join(" ")
        ));
    }
    if cc_version.is_some() {
        r.row("cached 4K pread p50", "ns", true, &cells(&acc.pread, |a| &a.p50));
        r.row("cached 4K pread mean", "ns", true, &cells(&acc.pread, |a| &a.mean));
        r.notes.push(format!(
            "cached 4K pread: pread_lat.c reads a {} MiB file whole, then times {} preads of 4 KiB at random \
             offsets one by one (CLOCK_MONOTONIC around each); capi: capi_lat.c the same through pwfs_pread on \
             an image it makes and mounts with the C ABI's defaults (the engine in the process)",
            s.pread_mib, s.preads
        ));
    }
    r.notes.push(format!(
        "ext4: the directory {} ({}); fuse and shim: FUSE mounts of {} (pwfs mount's defaults) served by this \
         process, a fresh mount per cell",
        b.kdir.display(),
        host_fs,
        b.image.display()
    ));
    if !b.root {
        r.notes.push("not root: cold starts drop the ext4 files' pages with POSIX_FADV_DONTNEED".into());
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fio's JSON (3.33), parsed without fio: ops/s from the mean latency, the
    /// fdatasync's time added for a write job.
    #[test]
    fn parses_fio_output() {
        let out = r#"note: a line before the JSON
{"jobs": [
  {"jobname": "cold", "read": {"total_ios": 100, "lat_ns": {"mean": 50000.0},
   "clat_ns": {"percentile": {"50.000000": 40960}}}, "write": {"total_ios": 0},
   "sync": {"lat_ns": {"N": 0}}},
  {"jobname": "fdatasync", "read": {"total_ios": 0},
   "write": {"total_ios": 50, "lat_ns": {"mean": 10000.0}, "clat_ns": {"percentile": {"50.000000": 9000}}},
   "sync": {"lat_ns": {"mean": 90000.0, "N": 50, "percentile": {"50.000000": 80384}}}}
]}"#;
        let cold = fio_job(out, "cold", "read").unwrap();
        assert_eq!(cold, FioJob { ops: 20_000.0, p50_us: 40.96, sync_p50_us: None });
        let sync = fio_job(out, "fdatasync", "write").unwrap();
        assert_eq!(sync.ops, 10_000.0);
        assert_eq!(sync.sync_p50_us, Some(80.384));
        assert!(fio_job(out, "cold", "write").unwrap_err().contains("no writes"));
        assert!(fio_job(out, "cached", "read").is_err());
        assert!(fio_job("fio: no such file", "cold", "read").is_err());
    }

    #[test]
    fn parses_the_c_programs_output() {
        assert_eq!(parse_lat("p50_ns=513 mean_ns=522.7 n=100000\n"), Ok((513.0, 522.7)));
        assert!(parse_lat("p50_ns=0 mean_ns=1 n=1").is_err());
        assert!(parse_lat("").is_err());
    }

    /// The smoke run fills every cell of the parts whose programs are installed, with
    /// ext4 and fuse at least (as root with /dev/fuse; elsewhere it says so). The shim
    /// and the C ABI take part when their libraries are found, and are noted otherwise.
    #[test]
    fn smoke_run_fills_the_table() {
        let _one_at_a_time = crate::smoke_lock();
        if !pwfs_fuse::can_mount() {
            eprintln!("skipping: needs root and /dev/fuse");
            return;
        }
        let dir = std::env::temp_dir().join(format!("pwfs-bench-apps-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        r.check_filled().unwrap();
        assert_eq!(&r.columns[..2], ["ext4", "fuse"]);
        let shim = r.columns.iter().any(|c| c == "shim");
        assert_eq!(shim, !r.notes.iter().any(|n| n.starts_with("shim column skipped")), "{:?}", r.notes);
        for part in PARTS {
            let skipped = r.notes.iter().any(|n| n.starts_with(&format!("{part} skipped")));
            let prefix = match part {
                "db_bench" => "db_bench",
                "sqlite" => "sqlite3",
                "fio" => "fio",
                _ => "cached 4K pread",
            };
            let rows: Vec<_> = r.rows.iter().filter(|row| row.name.starts_with(prefix)).collect();
            assert_eq!(rows.is_empty(), skipped, "{part}: {:?}", r.notes);
            for row in rows {
                for col in ["ext4", "fuse"].iter().chain(shim.then_some(&"shim")) {
                    assert!(row.values.contains_key(*col), "{} has no {col}", row.name);
                }
            }
        }
        assert!(r.json()["device"]["read_4k_us"].as_f64().is_some_and(|v| v > 0.0));
        // `--only` runs the parts named, and refuses a name it does not know.
        let bad = Opts { only: vec!["sqlite3".into()], ..Opts::smoke(dir.clone()) };
        assert!(run(&bad, &mut |_| {}).unwrap_err().contains("unknown part"));
    }
}
