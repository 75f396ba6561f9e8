//! Named benchmark workloads for Patchwork, each run side by side with the Linux
//! kernel on the same disk in one run, so that ratios (not absolute times, which
//! drift on a shared machine) are what gets reported.
//!
//! Workloads (`pwfs bench <name>`):
//! - `aios`: the asynchronous I/O stack experiment: cold reads of 4-128 KiB at queue
//!   depth 1 (with the engine's before/device/after breakdown), cold 4 KiB reads from
//!   1-4 threads, write+fsync latency, RocksDB db_bench through a FUSE mount; Sync,
//!   Async and Async+polling mounts against ext4 and raw io_uring O_DIRECT reads of the
//!   image.
//! - `apps`: unmodified programs — RocksDB db_bench (fills, cold lookups), sqlite3
//!   (one insert per transaction, DELETE and WAL journals), fio (psync 4 KiB reads cold
//!   and cached, overwrite+fdatasync) — and the time of one cached 4 KiB pread, on
//!   ext4, a FUSE mount, and the same mount under the LD_PRELOAD shim (and the C ABI).
//! - `basic`: cold 4 KiB random reads at queue depth 1, 4 KiB write+fsync, 1 MiB
//!   sequential write and cold read, warm 4 KiB reads; against ext4 buffered, ext4
//!   O_DIRECT, and raw io_uring O_DIRECT reads of the image (the device floor).
//! - `fuse`: untar, 4 KiB random writes with fsync every 64, cold 4 KiB random reads,
//!   1 MiB sequential write and read, `git status` over 10,000 files; on a pwfs FUSE
//!   mount against ext4 on the same disk.
//! - `hitchhike`: small synchronous writes (mechanism 3): appends and random overwrites
//!   of 64 B-4 KiB with fsync after each and a varmail-like mix, with hitchhiking on
//!   and off, against ext4 and ext4 with fast commits (a loop device); ops/s, latency,
//!   device writes, bytes and flushes per op, and the recognition ratio of small writes
//!   beside the Hitchhike paper's Table 2.
//! - `nbw`: the non-blocking-writes experiment: five Filebench personalities × six
//!   I/O sizes, fetch policies Blocking/Async-FG/Async-BG/Lazy against ext4, cold.
//! - `scale`: 1, 2, 4 and 8 threads doing overwrites, shared cached reads,
//!   create+stat+unlink and small writes into cached pages, against ext4.
//!
//! Every report records the device's own 4 KiB read and flush latency.

pub mod aios;
pub mod apps;
pub mod basic;
pub mod fuse;
pub mod hitchhike;
pub mod kernel;
pub mod memcg;
pub mod nbw;
pub mod personalities;
pub mod programs;
pub mod report;
pub mod scale;

pub use report::{DeviceProbe, Report, Row};

use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Opts {
    /// Where the image and the kernel's files go (the same disk for both).
    pub dir: PathBuf,
    /// Size of the test file, in MiB.
    pub file_mib: u64,
    /// Random reads (and write+fsync pairs) measured per column.
    pub ops: usize,
    /// Repetitions of throughput runs; the median is reported.
    pub runs: usize,
    pub seed: u64,
    /// Parts of the workload to run (`pwfs bench nbw --only randread,seqread`); empty:
    /// all of them.
    pub only: Vec<String>,
}

impl Opts {
    /// Full size: a file larger than the default cache, thousands of samples.
    pub fn full(dir: PathBuf) -> Opts {
        Opts { dir, file_mib: 1024, ops: 4000, runs: 3, seed: 42, only: Vec::new() }
    }
    /// `--quick`: the README's first run; a minute or so.
    pub fn quick(dir: PathBuf) -> Opts {
        Opts { dir, file_mib: 256, ops: 2000, runs: 3, seed: 42, only: Vec::new() }
    }
    /// `--smoke`: seconds; CI runs it so the benchmarks cannot rot.
    pub fn smoke(dir: PathBuf) -> Opts {
        Opts { dir, file_mib: 16, ops: 100, runs: 1, seed: 42, only: Vec::new() }
    }
}

/// Latency samples in microseconds → (p50, p99).
pub fn percentiles(mut us: Vec<f64>) -> (f64, f64) {
    if us.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    us.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| us[((us.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99))
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// A permutation of `n` page indices (distinct, so cold reads never hit).
pub fn shuffled_pages(n: u64, take: usize, seed: u64) -> Vec<u64> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut v: Vec<u64> = (0..n).collect();
    v.shuffle(&mut rng);
    v.truncate(take);
    v
}

/// The smoke tests run one at a time: they mount images while others fork programs
/// (git, tar), and a child between fork and exec holds a copy of every descriptor,
/// the image's locked one included, so that the next mount of that image can find it
/// "in use" for a moment. (The tests also measure less noisily alone.)
#[cfg(test)]
pub(crate) fn smoke_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
