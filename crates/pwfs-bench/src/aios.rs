//! `pwfs bench aios`: the asynchronous I/O stack (mechanism 4) against the synchronous
//! one, the kernel and the raw device, in one run.
//!
//! Columns: `sync` (`Stack::Sync`), `async` (`Stack::Async`) and `async+poll`
//! (`Stack::Async` with hybrid polling), each a mount of its own over the same image
//! (a small cache, `trace_io` on); `raw-uring` (io_uring O_DIRECT reads of the image
//! itself: the device floor); `ext4-direct` and `ext4-cold` (O_DIRECT and buffered reads
//! of a file of the same size on the host's ext4, same disk; the buffered file's pages
//! are dropped with POSIX_FADV_DONTNEED before each cell); `ext4` (buffered write +
//! fsync on the host's ext4, parts (c) and (d)).
//!
//! Parts (`--only reads,threads,fsync,apps`):
//! - (a) `reads`: cold random reads at queue depth 1 of 4-128 KiB, offsets aligned to
//!   the size, p50 and p99; for 4 KiB also where the engine's time went (software
//!   before the device, device, software after; `Fs::io_times`) and the CPU time per
//!   read of the whole process (polling costs CPU);
//! - (b) `threads`: cold 4 KiB random reads from 1, 2 and 4 threads, IOPS;
//! - (c) `fsync`: write + fsync latency of 4 KiB overwrites of a preallocated file,
//!   4 KiB appends and 64 B appends, from 1 thread and from 4 (each its own file), with
//!   the device's writes and flushes per fsync (/sys/block/…/stat);
//! - (d) `apps`: RocksDB's `db_bench` (rocksdb-tools) on a FUSE mount of the image
//!   (default kernel cache mode) and in a directory on the host's ext4: `fillsync`
//!   (writes with sync=1), `fillseq`, and `readrandom` cold (a fresh mount, the kernel's
//!   caches dropped), ops/s. Needs root and /dev/fuse, and db_bench on PATH; left out
//!   of the smoke run.
//!
//! Cold: every pwfs cell is a fresh mount (an empty cache), and no two cells of the
//! same size read the same offsets, so no column can serve a read from memory (ours or
//! the kernel's). Each cell runs `runs` times, the order of the columns rotating from
//! one round to the next, so that drift of this shared machine falls on all of them.

use crate::basic::{make_image, open_raw};
use crate::kernel::KFile;
use crate::programs::{db_bench, db_bench_flags, db_bench_version, drop_caches, sst_bytes, Place};
use crate::report::DeviceProbe;
use crate::{median, percentiles, shuffled_pages, Opts, Report};
use pwfs::device::uring::UringDevice;
use pwfs::device::{AlignedBuf, Device};
use pwfs::{Config, Fs, OpenOptions, PathTimes, Stack};
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::Instant;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

/// The cache of every pwfs column (the file is larger in full runs).
pub const CACHE_BYTES: u64 = 64 * MIB;
/// Sizes of the reads of part (a), in KiB.
pub const SIZES_KIB: [u64; 6] = [4, 8, 16, 32, 64, 128];
/// Threads of part (b).
pub const READ_THREADS: [usize; 3] = [1, 2, 4];
/// Threads of part (c).
pub const FSYNC_THREADS: [usize; 2] = [1, 4];
/// The parts `--only` takes.
pub const PARTS: [&str; 4] = ["reads", "threads", "fsync", "apps"];
/// Each preallocated file of the overwrites of part (c).
const OVERWRITE_BYTES: u64 = 4 * MIB;
/// The pwfs file every read goes to.
const DATA: &str = "/data";

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// User + system CPU time of this process (every thread, the engine's included), us.
fn cpu_us() -> f64 {
    // SAFETY: an all-zero rusage is a valid value; getrusage fills it in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall writing into the struct we pass.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Col {
    Sync,
    Async,
    AsyncPoll,
    Raw,
    Ext4Direct,
    Ext4Cold,
    Ext4,
}

/// The columns of parts (a) and (b), and of part (c).
const READ_COLS: [Col; 6] = [Col::Sync, Col::Async, Col::AsyncPoll, Col::Raw, Col::Ext4Direct, Col::Ext4Cold];
const FSYNC_COLS: [Col; 4] = [Col::Sync, Col::Async, Col::AsyncPoll, Col::Ext4];
const PWFS_COLS: [Col; 3] = [Col::Sync, Col::Async, Col::AsyncPoll];
/// Part (d)'s columns: a pwfs column through the FUSE mount or with its programs under
/// the LD_PRELOAD shim, or ext4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct AppsCol {
    col: Col,
    shim: bool,
}

impl AppsCol {
    const fn fuse(col: Col) -> AppsCol {
        AppsCol { col, shim: false }
    }

    fn name(self) -> &'static str {
        match (self.col, self.shim) {
            (Col::Sync, true) => "sync+shim",
            (Col::Async, true) => "async+shim",
            (Col::AsyncPoll, true) => "async+poll+shim",
            (c, _) => c.name(),
        }
    }
}

const APPS_FUSE_COLS: [AppsCol; 4] =
    [AppsCol::fuse(Col::Sync), AppsCol::fuse(Col::Async), AppsCol::fuse(Col::AsyncPoll), AppsCol::fuse(Col::Ext4)];
const APPS_SHIM_COLS: [AppsCol; 2] = [AppsCol { col: Col::Sync, shim: true }, AppsCol { col: Col::Async, shim: true }];
/// Columns reading one file share its offsets out: at most this many per file (the
/// image: three mounts and the raw device).
const SHARES: u64 = 4;

impl Col {
    fn name(self) -> &'static str {
        match self {
            Col::Sync => "sync",
            Col::Async => "async",
            Col::AsyncPoll => "async+poll",
            Col::Raw => "raw-uring",
            Col::Ext4Direct => "ext4-direct",
            Col::Ext4Cold => "ext4-cold",
            Col::Ext4 => "ext4",
        }
    }

    /// The mount of a pwfs column.
    fn config(self) -> Option<Config> {
        let (stack, poll) = match self {
            Col::Sync => (Stack::Sync, false),
            Col::Async => (Stack::Async, false),
            Col::AsyncPoll => (Stack::Async, true),
            _ => return None,
        };
        Some(Config { cache_bytes: CACHE_BYTES, stack, poll, trace_io: true, ..Default::default() })
    }

    /// Which share of a file's offsets the column reads: the image's for pwfs and the
    /// raw device, the kernel file's for ext4.
    fn share(self) -> u64 {
        match self {
            Col::Sync | Col::Ext4Direct | Col::Ext4 => 0,
            Col::Async | Col::Ext4Cold => 1,
            Col::AsyncPoll => 2,
            Col::Raw => 3,
        }
    }

    fn on_image(self) -> bool {
        matches!(self, Col::Sync | Col::Async | Col::AsyncPoll | Col::Raw)
    }
}

/// Where the files are.
struct Bench {
    image: PathBuf,
    /// Byte offset of the image's data region (the raw device's reads land there).
    base: u64,
    /// The kernel's file for reads, as large as `/data`.
    kfile: PathBuf,
    /// The kernel's directory for part (c).
    kdir: PathBuf,
    file_bytes: u64,
}

impl Bench {
    fn mount(&self, col: Col) -> R<Fs> {
        let config = col.config().ok_or("not a pwfs column")?;
        pwfs::mount_image(&self.image, config).map_err(err("mount"))
    }
}

/// Warm-up reads per column: one per thread, before the clock starts (a thread's first
/// request on a device sets up its io_uring ring and registers the buffer arena).
const WARM: usize = 4;

/// Distinct offsets of `size`-byte reads: each column sharing a file gets `n` (in
/// rounds of `n / rounds`) and `WARM` more for warm-ups, none of them another
/// column's; `n` shrinks if the file has too few slots.
struct Offsets {
    image: Vec<u64>,
    kernel: Vec<u64>,
    size: u64,
    n: usize,
}

impl Offsets {
    fn new(file_bytes: u64, size: u64, n: usize, seed: u64) -> Offsets {
        let slots = file_bytes / size;
        let n = n.min(((slots / SHARES) as usize).saturating_sub(WARM));
        let take = (n + WARM) * SHARES as usize;
        Offsets {
            image: shuffled_pages(slots, take, seed),
            kernel: shuffled_pages(slots, take, seed ^ 0x5eed_0000),
            size,
            n,
        }
    }

    fn all(&self, col: Col) -> &[u64] {
        let all = if col.on_image() { &self.image } else { &self.kernel };
        &all[col.share() as usize * (self.n + WARM)..][..self.n + WARM]
    }

    /// The offsets (bytes) of `col` in round `round` of `rounds`.
    fn of(&self, col: Col, round: usize, rounds: usize) -> Vec<u64> {
        let per = self.n / rounds;
        self.all(col)[round * per..][..per].iter().map(|s| s * self.size).collect()
    }

    /// The offsets (bytes) of `col`'s warm-up reads, one per thread.
    fn warm(&self, col: Col) -> Vec<u64> {
        self.all(col)[self.n..].iter().map(|s| s * self.size).collect()
    }
}

/// An open reader of one column: a fresh mount, the raw image, or the kernel's file
/// (its pages dropped).
enum Reader {
    Pwfs(Fs, pwfs::File),
    Raw(UringDevice, u64),
    Kernel(KFile),
}

impl Reader {
    fn open(b: &Bench, col: Col) -> R<Reader> {
        Ok(match col {
            Col::Sync | Col::Async | Col::AsyncPoll => {
                let fs = b.mount(col)?;
                let f = OpenOptions::new().read(true).open(&fs, DATA).map_err(err("open"))?;
                Reader::Pwfs(fs, f)
            }
            Col::Raw => Reader::Raw(open_raw(&b.image)?, b.base),
            Col::Ext4Direct | Col::Ext4Cold => {
                let f = KFile::open(&b.kfile, col == Col::Ext4Direct, false).map_err(err("open"))?;
                f.drop_cache();
                Reader::Kernel(f)
            }
            Col::Ext4 => return Err("ext4 is a column of part (c) only".into()),
        })
    }

    /// Read `buf.len()` bytes at `off`, whole.
    fn read(&self, off: u64, buf: &mut AlignedBuf) -> R<()> {
        match self {
            Reader::Pwfs(_, f) => {
                let n = f.read_at(buf, off).map_err(err("read"))?;
                if n != buf.len() {
                    return Err(format!("short read: {n} of {}", buf.len()));
                }
            }
            Reader::Raw(dev, base) => {
                let (_, r) = dev.read(base + off, dev.alloc(buf.len()));
                r.map_err(err("raw read"))?;
            }
            Reader::Kernel(f) => f.pread(buf, off).map_err(err("pread"))?,
        }
        Ok(())
    }

    fn io_reads(&self) -> Option<PathTimes> {
        match self {
            Reader::Pwfs(fs, _) => Some(fs.io_times().reads),
            _ => None,
        }
    }

    /// Unmount (nothing was written: no sync first).
    fn close(self) -> R<()> {
        match self {
            Reader::Pwfs(fs, f) => {
                drop(f);
                fs.unmount().map_err(err("unmount"))
            }
            _ => Ok(()),
        }
    }
}

fn sub(a: PathTimes, b: PathTimes) -> PathTimes {
    PathTimes {
        count: a.count - b.count,
        before_ns: a.before_ns - b.before_ns,
        device_ns: a.device_ns - b.device_ns,
        after_ns: a.after_ns - b.after_ns,
    }
}

fn add(a: &mut PathTimes, d: PathTimes) {
    a.count += d.count;
    a.before_ns += d.before_ns;
    a.device_ns += d.device_ns;
    a.after_ns += d.after_ns;
}

/// Part (a)'s samples of one column at one size, over the rounds.
#[derive(Default)]
struct ReadAcc {
    lat: Vec<f64>,
    times: PathTimes,
    cpu_us: f64,
}

/// One cell of part (a): `offs` read one at a time, cold, after one read of `warm`.
fn read_cell(b: &Bench, col: Col, size: u64, warm: u64, offs: &[u64], acc: &mut ReadAcc) -> R<()> {
    let r = Reader::open(b, col)?;
    let mut buf = AlignedBuf::new(size as usize);
    r.read(warm, &mut buf)?;
    let t0 = r.io_reads();
    let c0 = cpu_us();
    for &off in offs {
        let t = Instant::now();
        r.read(off, &mut buf)?;
        acc.lat.push(us(t));
    }
    acc.cpu_us += cpu_us() - c0;
    if let (Some(t0), Some(t1)) = (t0, r.io_reads()) {
        add(&mut acc.times, sub(t1, t0));
    }
    r.close()
}

/// Run `threads` threads: each runs `warm(t)` (untimed); once every warm-up is done,
/// the calling thread runs `at_start`, and then all of them `work(t, warmed)` at once.
/// Their results, and the wall time (s) from the first thread's start to the last
/// one's end, as the threads themselves clock it (the calling thread may be
/// descheduled meanwhile).
fn in_threads<W, T: Send>(
    threads: usize,
    warm: impl Fn(usize) -> R<W> + Sync,
    work: impl Fn(usize, W) -> R<T> + Sync,
    at_start: impl FnOnce(),
) -> R<(Vec<T>, f64)> {
    let (ready, go) = (Barrier::new(threads + 1), Barrier::new(threads + 1));
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (ready, go, warm, work) = (&ready, &go, &warm, &work);
                s.spawn(move || {
                    let warmed = warm(t);
                    ready.wait();
                    go.wait();
                    let start = Instant::now();
                    let r = warmed.and_then(|w| work(t, w));
                    (r, start, Instant::now())
                })
            })
            .collect();
        ready.wait();
        at_start();
        go.wait();
        handles.into_iter().map(|h| h.join().map_err(|_| "a bench thread panicked".to_string())).collect::<Vec<_>>()
    });
    let (mut results, mut first, mut last) = (Vec::new(), None::<Instant>, None::<Instant>);
    for o in out {
        let (r, start, end) = o?;
        results.push(r?);
        first = Some(first.map_or(start, |f| f.min(start)));
        last = Some(last.map_or(end, |l| l.max(end)));
    }
    let secs = match (first, last) {
        (Some(f), Some(l)) => l.saturating_duration_since(f).as_secs_f64(),
        _ => f64::NAN,
    };
    Ok((results, secs))
}

/// One cell of part (b): `offs` read by `threads` threads, each its own slice, after
/// one read of its own of `warm`; IOPS.
fn threads_cell(b: &Bench, col: Col, threads: usize, warm: &[u64], offs: &[u64]) -> R<f64> {
    let r = Reader::open(b, col)?;
    let per = offs.len() / threads;
    let warm_up = |t: usize| {
        let mut buf = AlignedBuf::new(PAGE as usize);
        r.read(warm[t], &mut buf)?;
        Ok(buf)
    };
    let work = |t: usize, mut buf: AlignedBuf| {
        for &off in &offs[t * per..(t + 1) * per] {
            r.read(off, &mut buf)?;
        }
        Ok(())
    };
    let (_, secs) = in_threads(threads, warm_up, work, || {})?;
    r.close()?;
    Ok((per * threads) as f64 / secs)
}

/// The writes of part (c).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum WriteKind {
    Overwrite4K,
    Append4K,
    Append64,
}

impl WriteKind {
    const ALL: [WriteKind; 3] = [WriteKind::Overwrite4K, WriteKind::Append4K, WriteKind::Append64];

    fn label(self) -> &'static str {
        match self {
            WriteKind::Overwrite4K => "4K overwrite",
            WriteKind::Append4K => "4K append",
            WriteKind::Append64 => "64B append",
        }
    }

    fn len(self) -> usize {
        match self {
            WriteKind::Append64 => 64,
            _ => PAGE as usize,
        }
    }

    /// The file thread `t` writes (relative to the file system's root or the kernel's
    /// directory).
    fn file(self, t: usize) -> String {
        match self {
            WriteKind::Overwrite4K => format!("ow{t}"),
            _ => format!("ap{t}"),
        }
    }
}

/// A file written by one thread of part (c).
enum WFile {
    Pwfs(pwfs::File),
    Ext4(std::fs::File),
}

impl WFile {
    fn write_fsync(&self, data: &[u8], off: u64) -> R<()> {
        match self {
            WFile::Pwfs(f) => {
                let n = f.write_at(data, off).map_err(err("write"))?;
                if n != data.len() {
                    return Err(format!("short write: {n} of {}", data.len()));
                }
                f.sync_all().map_err(err("fsync"))
            }
            WFile::Ext4(f) => {
                f.write_all_at(data, off).map_err(err("pwrite"))?;
                f.sync_all().map_err(err("fsync"))
            }
        }
    }
}

/// The block device under `dir`: its (or its partition's) stat file in sysfs.
fn device_stat_path(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let d = std::fs::metadata(dir).ok()?.dev();
    // glibc's encoding of dev_t (gnu_dev_major / gnu_dev_minor).
    let major = ((d >> 8) & 0xfff) | ((d >> 32) & !0xfff);
    let minor = (d & 0xff) | ((d >> 12) & !0xff);
    let p = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    p.exists().then_some(p)
}

/// Writes completed and flushes completed: fields 5 and 16 (1-based) of the stat file
/// (Documentation/block/stat.rst: field 15 is the time spent on discards; the flush
/// fields, 16 and 17, came with Linux 5.5). Either is None when the file does not
/// have it.
fn device_counts(stat: Option<&Path>) -> (Option<u64>, Option<u64>) {
    let Some(s) = stat.and_then(|p| std::fs::read_to_string(p).ok()) else {
        return (None, None);
    };
    let fields: Vec<Option<u64>> = s.split_whitespace().map(|x| x.parse().ok()).collect();
    (fields.get(4).copied().flatten(), fields.get(15).copied().flatten())
}

/// Part (c)'s samples of one cell, over the rounds.
#[derive(Default)]
struct FsyncAcc {
    lat: Vec<f64>,
    fsyncs: u64,
    writes: Option<u64>,
    flushes: Option<u64>,
    times: PathTimes,
}

fn delta(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    Some(b?.saturating_sub(a?))
}

fn plus(acc: Option<u64>, d: Option<u64>, first: bool) -> Option<u64> {
    if first {
        d
    } else {
        Some(acc? + d?)
    }
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// One cell of part (c): `threads` threads, `n` write+fsync pairs each, on files of
/// their own.
fn fsync_cell(
    b: &Bench,
    col: Col,
    kind: WriteKind,
    threads: usize,
    n: usize,
    stat: Option<&Path>,
    acc: &mut FsyncAcc,
) -> R<()> {
    let append = kind != WriteKind::Overwrite4K;
    let fs = match col {
        Col::Ext4 => None,
        _ => Some(b.mount(col)?),
    };
    let mut files = Vec::new();
    for t in 0..threads {
        let name = kind.file(t);
        files.push(match &fs {
            Some(fs) => {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(append)
                    .truncate(append)
                    .open(fs, format!("/{name}"))
                    .map_err(err("open"))?;
                WFile::Pwfs(f)
            }
            None => {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(append)
                    .truncate(append)
                    .open(b.kdir.join(&name))
                    .map_err(err("open"))?;
                // The truncate is durable before the clock starts, as the engine's
                // is (its sync below).
                f.sync_all().map_err(err("fsync"))?;
                WFile::Ext4(f)
            }
        });
    }
    if let Some(fs) = &fs {
        fs.sync().map_err(err("sync"))?;
    }
    let first = acc.fsyncs == 0;
    let fl = &files;
    let next = |rng: &mut u64, end: &mut u64| {
        let off = if append { *end } else { (xorshift(rng) % (OVERWRITE_BYTES / PAGE)) * PAGE };
        *end += kind.len() as u64;
        off
    };
    // One write+fsync per thread before the clock (and the counters) start.
    let warm_up = |t: usize| {
        let data = vec![0xa5u8 ^ t as u8; kind.len()];
        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
        let mut end = 0u64;
        fl[t].write_fsync(&data, next(&mut rng, &mut end))?;
        Ok((data, rng, end))
    };
    let work = |t: usize, (data, mut rng, mut end): (Vec<u8>, u64, u64)| {
        let mut lat = Vec::with_capacity(n);
        for _ in 0..n {
            let off = next(&mut rng, &mut end);
            let t0 = Instant::now();
            fl[t].write_fsync(&data, off)?;
            lat.push(us(t0));
        }
        Ok(lat)
    };
    let mut before = None;
    let (lat, _) = in_threads(threads, warm_up, work, || {
        before = Some((fs.as_ref().map(|fs| fs.io_times().fsyncs), device_counts(stat)));
    })?;
    let (times0, (w0, f0)) = before.expect("taken before the threads start");
    let (w1, f1) = device_counts(stat);
    acc.lat.extend(lat.into_iter().flatten());
    acc.fsyncs += (threads * n) as u64;
    acc.writes = plus(acc.writes, delta(w0, w1), first);
    acc.flushes = plus(acc.flushes, delta(f0, f1), first);
    drop(files);
    if let Some(fs) = fs {
        if let Some(t0) = times0 {
            add(&mut acc.times, sub(fs.io_times().fsyncs, t0));
        }
        fs.sync().map_err(err("sync"))?;
        fs.unmount().map_err(err("unmount"))?;
    }
    Ok(())
}

/// Sizes of part (d): `fillsync` writes (each with sync=1), `fillseq` keys (16 B keys,
/// 100 B values) and cold `readrandom` lookups of them, per cell.
#[derive(Debug, Clone, Copy)]
struct AppsSizes {
    syncs: usize,
    fill: usize,
    reads: usize,
}

impl AppsSizes {
    /// 2000 / 1,000,000 / 8000 in a full run (110 MiB of SSTs: more than the engine's
    /// cache), 500 / 500,000 / 4000 in a quick one (about 1.5 minutes, four columns,
    /// three rounds); the lookups well under the database's 4 KiB blocks, so that most
    /// of them land on a block no earlier lookup read. (fillseq through FUSE makes one
    /// request per put: the WAL's writes are small and the default mount caches no
    /// writes.)
    fn of(o: &Opts) -> AppsSizes {
        if o.ops <= 2000 {
            AppsSizes { syncs: 500, fill: 500_000, reads: 4000 }
        } else {
            AppsSizes { syncs: 2000, fill: 1_000_000, reads: 8000 }
        }
    }

    /// Room on the image for the databases of one cell (SSTs, logs, the fillsync one).
    fn image_bytes(self) -> u64 {
        (self.fill as u64 * 512).div_ceil(MIB) * MIB + 128 * MIB
    }
}

/// Where part (d)'s databases go: the root of a FUSE mount (default kernel cache mode,
/// the shim served) of a fresh `Fs` over the image, or the kernel's directory beside it.
fn apps_place(b: &Bench, col: Col, mnt: &Path, kdir: &Path) -> R<Place> {
    match col.config() {
        Some(config) => {
            Place::fuse(&b.image, config, mnt, &pwfs_fuse::MountOptions { shim: true, ..Default::default() })
        }
        None => Place::dir(kdir),
    }
}

/// Part (d)'s figures of one column, over the rounds (ops/s).
#[derive(Default)]
struct AppsAcc {
    fillsync: Vec<f64>,
    fillseq: Vec<f64>,
    cold: Vec<f64>,
    warm: Vec<f64>,
    /// The SST files' bytes after fillseq.
    sst_bytes: u64,
}

/// One cell of part (d): fillsync and fillseq on a fresh mount (ext4: the kernel's
/// directory, its caches dropped first); the file system unmounted, the kernel's
/// caches dropped, and readrandom on a fresh mount (cold), then again (warm). The
/// databases and the mount point are gone afterwards.
fn apps_cell(
    b: &Bench,
    col: Col,
    preload: Option<&Path>,
    s: AppsSizes,
    seed: u64,
    dirs: (&Path, &Path),
    acc: &mut AppsAcc,
) -> R<()> {
    let (mnt, kdir) = dirs;
    let num = |n: usize| format!("--num={n}");
    drop_caches()?;
    let place = apps_place(b, col, mnt, kdir)?;
    let (db, db_sync) = (place.dir.join("db"), place.dir.join("db-sync"));
    let filled = db_bench(&db_sync, "fillsync", seed, &[num(s.syncs)], preload)
        .and_then(|v| {
            acc.fillsync.push(v);
            std::fs::remove_dir_all(&db_sync).map_err(err("remove the fillsync db"))
        })
        .and_then(|_| db_bench(&db, "fillseq", seed, &[num(s.fill)], preload))
        .map(|v| {
            acc.fillseq.push(v);
            acc.sst_bytes = acc.sst_bytes.max(sst_bytes(&db));
        });
    if filled.is_err() {
        let _ = std::fs::remove_dir_all(&db_sync);
        let _ = std::fs::remove_dir_all(&db);
    }
    let closed = place.close();
    filled?;
    closed?;

    drop_caches()?;
    let place = apps_place(b, col, mnt, kdir)?;
    let db = place.dir.join("db");
    let read = [num(s.fill), format!("--reads={}", s.reads), "--use_existing_db=1".into()];
    let cold = db_bench(&db, "readrandom", seed, &read, preload);
    let warm = cold.as_ref().map_err(|e| e.clone()).and_then(|_| db_bench(&db, "readrandom", seed, &read, preload));
    let removed = std::fs::remove_dir_all(&db).map_err(err("remove the db"));
    let closed = place.close();
    acc.cold.push(cold?);
    acc.warm.push(warm?);
    removed?;
    closed
}

/// The files every part expects: `/data` on the image and the kernel's file of the
/// same size (for reads), and the preallocated files of the overwrites on both sides.
fn prepare(b: &mut Bench, reads: bool, fsync: bool, progress: &mut dyn FnMut(&str)) -> R<()> {
    let fs =
        pwfs::mount_image(&b.image, Config { cache_bytes: CACHE_BYTES, ..Default::default() }).map_err(err("mount"))?;
    b.base = fs.superblock().data_start * PAGE;
    let chunk = vec![0x5au8; MIB as usize];
    if reads {
        progress("writing the pwfs file");
        let f = OpenOptions::new().write(true).create(true).truncate(true).open(&fs, DATA).map_err(err("create"))?;
        for i in 0..b.file_bytes / MIB {
            f.write_all_at(&chunk, i * MIB).map_err(err("write"))?;
        }
        f.sync_all().map_err(err("fsync"))?;
    }
    if fsync {
        for t in 0..FSYNC_THREADS[FSYNC_THREADS.len() - 1] {
            let name = WriteKind::Overwrite4K.file(t);
            fs.write_file(format!("/{name}"), &vec![0x11u8; OVERWRITE_BYTES as usize]).map_err(err("pwfs prepare"))?;
            let path = b.kdir.join(&name);
            std::fs::write(&path, vec![0x11u8; OVERWRITE_BYTES as usize]).map_err(err("ext4 prepare"))?;
            std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(err("ext4 fsync"))?;
        }
    }
    fs.sync().map_err(err("sync"))?;
    fs.unmount().map_err(err("unmount"))?;
    if reads {
        progress("writing the ext4 file");
        let mut c = AlignedBuf::new(MIB as usize);
        c.fill(0x5a);
        let f = KFile::open(&b.kfile, true, true).map_err(err("create ext4 file"))?;
        for i in 0..b.file_bytes / MIB {
            f.pwrite(&c, i * MIB).map_err(err("pwrite"))?;
        }
        f.fsync().map_err(err("fsync"))?;
    }
    Ok(())
}

/// Reads per size per column, and write+fsync pairs per cell: 2000 and 1000 in a full
/// run, 500 and 250 in a quick one, 20 in a smoke run (`Opts::ops` is 4000, 2000 and
/// 100 there).
fn counts(o: &Opts) -> (usize, usize) {
    match o.ops {
        n if n <= 100 => (20, 20),
        n if n <= 2000 => (500, 250),
        n => (n / 2, n / 4),
    }
}

fn ns_avg_us(ns: u64, count: u64) -> f64 {
    if count == 0 {
        f64::NAN
    } else {
        ns as f64 / count as f64 / 1e3
    }
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    for part in &o.only {
        if !PARTS.contains(&part.as_str()) {
            return Err(format!("unknown part {part:?} of bench aios (known: {})", PARTS.join(", ")));
        }
    }
    let runs = |p: &str| o.only.is_empty() || o.only.iter().any(|x| x == p);
    let (do_reads, do_threads, do_fsync) = (runs("reads"), runs("threads"), runs("fsync"));
    // Part (d) needs a FUSE mount and db_bench, and is never part of the smoke run
    // (CI has neither rocksdb-tools nor the time).
    let mut notes = Vec::new();
    let apps_version = if !runs("apps") {
        None
    } else if o.ops <= 100 {
        notes.push("(d) skipped: not part of the smoke run".to_string());
        None
    } else if !pwfs_fuse::can_mount() {
        notes.push("(d) skipped: a FUSE mount needs root and /dev/fuse".to_string());
        None
    } else {
        let v = db_bench_version();
        if v.is_none() {
            notes.push("(d) skipped: db_bench not found (apt-get install rocksdb-tools)".to_string());
        }
        v
    };
    let do_apps = apps_version.is_some();
    let apps = AppsSizes::of(o);
    std::fs::create_dir_all(&o.dir).map_err(err("bench dir"))?;
    let device = DeviceProbe::measure(&o.dir);
    let stat = device_stat_path(&o.dir);
    let (reads, fsyncs) = counts(o);
    let rounds = o.runs.max(1);
    let file_bytes = o.file_mib * MIB;
    let mut b = Bench {
        image: o.dir.join("aios.img"),
        base: 0,
        kfile: o.dir.join("aios-ext4.dat"),
        kdir: o.dir.join("aios-ext4"),
        file_bytes,
    };
    let _ = std::fs::remove_dir_all(&b.kdir);
    std::fs::create_dir_all(&b.kdir).map_err(err("ext4 dir"))?;
    progress("preparing the image");
    let data = if do_reads || do_threads { file_bytes } else { 0 };
    let apps_room = if do_apps { apps.image_bytes() } else { 0 };
    make_image(&b.image, data + data / 8 + 96 * MIB + apps_room)?;
    prepare(&mut b, do_reads || do_threads, do_fsync, progress)?;

    // (a) cold reads by size.
    let mut a: HashMap<(u64, Col), ReadAcc> = HashMap::new();
    let mut a_n = reads;
    if do_reads {
        for (si, kib) in SIZES_KIB.into_iter().enumerate() {
            progress(&format!("(a) cold {kib} KiB reads"));
            let size = kib * KIB;
            let offs = Offsets::new(file_bytes, size, reads, o.seed + si as u64);
            a_n = a_n.min(offs.n / rounds * rounds);
            for round in 0..rounds {
                let mut cols = READ_COLS;
                cols.rotate_left((round + si) % READ_COLS.len());
                for col in cols {
                    let acc = a.entry((kib, col)).or_default();
                    read_cell(&b, col, size, offs.warm(col)[0], &offs.of(col, round, rounds), acc)?;
                }
            }
        }
    }

    // (b) cold 4 KiB reads by threads.
    let mut iops: HashMap<(usize, Col), Vec<f64>> = HashMap::new();
    if do_threads {
        for (ti, threads) in READ_THREADS.into_iter().enumerate() {
            progress(&format!("(b) cold 4 KiB reads, {threads} thread(s)"));
            let offs = Offsets::new(file_bytes, PAGE, reads, o.seed + 100 + ti as u64);
            for round in 0..rounds {
                let mut cols = READ_COLS;
                cols.rotate_left((round + ti) % READ_COLS.len());
                for col in cols {
                    let v = threads_cell(&b, col, threads, &offs.warm(col), &offs.of(col, round, rounds))?;
                    iops.entry((threads, col)).or_default().push(v);
                }
            }
        }
    }

    // (c) write + fsync.
    let mut c: HashMap<(WriteKind, usize, Col), FsyncAcc> = HashMap::new();
    if do_fsync {
        for (ki, kind) in WriteKind::ALL.into_iter().enumerate() {
            for threads in FSYNC_THREADS {
                progress(&format!("(c) {} + fsync, {threads} thread(s)", kind.label()));
                let per_thread = (fsyncs / rounds / threads).max(1);
                for round in 0..rounds {
                    let mut cols = FSYNC_COLS;
                    cols.rotate_left((round + ki + threads) % FSYNC_COLS.len());
                    for col in cols {
                        let acc = c.entry((kind, threads, col)).or_default();
                        fsync_cell(&b, col, kind, threads, per_thread, stat.as_deref(), acc)?;
                    }
                }
            }
        }
    }
    // (d) db_bench through a FUSE mount.
    let mut d: HashMap<AppsCol, AppsAcc> = HashMap::new();
    let mut apps_cols = APPS_FUSE_COLS.to_vec();
    let preload = if do_apps {
        let lib = crate::apps::locate(
            crate::apps::PRELOAD_ENV,
            crate::apps::PRELOAD_LIB,
            "cargo build --release -p pwfs-preload",
        )
        .and_then(|l| crate::apps::probe_preload(&l));
        match lib {
            Ok(lib) => {
                notes.push(format!("(d) shim columns: db_bench under LD_PRELOAD={}", lib.display()));
                apps_cols.extend(APPS_SHIM_COLS);
                Some(lib)
            }
            Err(why) => {
                notes.push(format!("(d) shim columns skipped: {why}"));
                None
            }
        }
    } else {
        None
    };
    if do_apps {
        let (mnt, kdir) = (o.dir.join("aios-apps-mnt"), o.dir.join("aios-apps-ext4"));
        let _ = std::fs::remove_dir_all(&kdir);
        for round in 0..rounds {
            progress(&format!("(d) db_bench fillsync, fillseq, readrandom cold, round {}", round + 1));
            let mut cols = apps_cols.clone();
            cols.rotate_left(round % apps_cols.len());
            for ac in cols {
                let acc = d.entry(ac).or_default();
                let lib = if ac.shim { preload.as_deref() } else { None };
                apps_cell(&b, ac.col, lib, apps, o.seed, (&mnt, &kdir), acc)
                    .map_err(|e| format!("(d) {}: {e}", ac.name()))?;
            }
        }
        let _ = std::fs::remove_dir_all(&kdir);
        let _ = std::fs::remove_dir(&mnt);
    }
    let _ = std::fs::remove_file(&b.image);
    let _ = std::fs::remove_file(&b.kfile);
    let _ = std::fs::remove_dir_all(&b.kdir);

    let mut columns: Vec<Col> = PWFS_COLS.to_vec();
    if do_reads || do_threads {
        columns.extend([Col::Raw, Col::Ext4Direct, Col::Ext4Cold]);
    }
    if do_fsync || do_apps {
        columns.push(Col::Ext4);
    }
    let mut column_names: Vec<String> = columns.iter().map(|c| c.name().to_string()).collect();
    if do_apps {
        column_names.extend(apps_cols.iter().filter(|c| c.shim).map(|c| c.name().to_string()));
    }
    let mut r = Report {
        title: format!(
            "pwfs bench aios: {} MiB file, pwfs cache {} MiB (a fresh mount per cell), {a_n} reads per size per column, \
             {fsyncs} write+fsync per cell{}, {rounds} round(s), columns rotated",
            o.file_mib,
            CACHE_BYTES / MIB,
            if do_apps {
                let AppsSizes { syncs, fill, reads } = apps;
                format!(", db_bench {syncs} fillsync / {fill} fillseq / {reads} readrandom per cell")
            } else {
                String::new()
            }
        ),
        columns: column_names,
        ratio_bases: vec![Col::Sync.name().into()],
        device: Some(device),
        notes,
        ..Default::default()
    };

    if do_reads {
        for kib in SIZES_KIB {
            let p: Vec<(f64, f64)> = READ_COLS.iter().map(|col| percentiles(a[&(kib, *col)].lat.clone())).collect();
            let cells = |q: fn(&(f64, f64)) -> f64| -> Vec<(&str, f64)> {
                READ_COLS.iter().zip(&p).map(|(col, v)| (col.name(), q(v))).collect()
            };
            r.row(&format!("(a) {kib}K read p50"), "us", true, &cells(|v| v.0));
            r.row(&format!("(a) {kib}K read p99"), "us", true, &cells(|v| v.1));
        }
        type Part = fn(&PathTimes) -> u64;
        let parts: [(&str, Part); 3] =
            [("before", |t| t.before_ns), ("device", |t| t.device_ns), ("after", |t| t.after_ns)];
        for (what, ns) in parts {
            let cells: Vec<(&str, f64)> = PWFS_COLS
                .iter()
                .map(|col| {
                    let t = &a[&(4, *col)].times;
                    (col.name(), ns_avg_us(ns(t), t.count))
                })
                .filter(|(_, v)| v.is_finite())
                .collect();
            r.row(&format!("(a) 4K {what}"), "us", true, &cells);
        }
        let cpu: Vec<(&str, f64)> = READ_COLS
            .iter()
            .map(|col| {
                let acc = &a[&(4, *col)];
                (col.name(), acc.cpu_us / acc.lat.len() as f64)
            })
            .collect();
        r.row("(a) 4K CPU per read", "us", true, &cpu);
        let traced: Vec<String> = PWFS_COLS
            .iter()
            .map(|col| format!("{} {} of {}", col.name(), a[&(4, *col)].times.count, a[&(4, *col)].lat.len()))
            .collect();
        r.notes.push(format!(
            "(a) 4K before/device/after: averages over the read misses Fs::io_times traced ({}); \
             CPU per read is the whole process's user+system time (getrusage) over the reads",
            traced.join(", ")
        ));
    }
    if do_threads {
        for threads in READ_THREADS {
            let cells: Vec<(&str, f64)> =
                READ_COLS.iter().map(|col| (col.name(), median(iops[&(threads, *col)].clone()))).collect();
            let name = if threads == 1 {
                "(b) 4K read, 1 thread".to_string()
            } else {
                format!("(b) 4K read, {threads} threads")
            };
            r.row(&name, "IOPS", false, &cells);
        }
    }
    if do_fsync {
        for kind in WriteKind::ALL {
            for threads in FSYNC_THREADS {
                let p: Vec<(f64, f64)> =
                    FSYNC_COLS.iter().map(|col| percentiles(c[&(kind, threads, *col)].lat.clone())).collect();
                let cells = |q: fn(&(f64, f64)) -> f64| -> Vec<(&str, f64)> {
                    FSYNC_COLS.iter().zip(&p).map(|(col, v)| (col.name(), q(v))).collect()
                };
                let label = kind.label();
                r.row(&format!("(c) {label}+fsync {threads}t p50"), "us", true, &cells(|v| v.0));
                r.row(&format!("(c) {label}+fsync {threads}t p99"), "us", true, &cells(|v| v.1));
            }
        }
        type Count = fn(&FsyncAcc) -> Option<u64>;
        let counters: [(&str, Count); 2] = [("writes", |x| x.writes), ("flushes", |x| x.flushes)];
        for kind in WriteKind::ALL {
            for threads in FSYNC_THREADS {
                for (what, get) in counters {
                    let cells: Vec<(&str, f64)> = FSYNC_COLS
                        .iter()
                        .filter_map(|col| {
                            let acc = &c[&(kind, threads, *col)];
                            get(acc).map(|v| (col.name(), v as f64 / acc.fsyncs as f64))
                        })
                        .collect();
                    if !cells.is_empty() {
                        r.row(&format!("(c) {} {threads}t device {what}", kind.label()), "per fsync", true, &cells);
                    }
                }
            }
        }
        let breakdown: Vec<String> = PWFS_COLS
            .iter()
            .map(|col| {
                let t = &c[&(WriteKind::Append4K, 1, *col)].times;
                format!(
                    "{} {:.1}/{:.1}/{:.1} us ({} traced)",
                    col.name(),
                    ns_avg_us(t.before_ns, t.count),
                    ns_avg_us(t.device_ns, t.count),
                    ns_avg_us(t.after_ns, t.count),
                    t.count
                )
            })
            .collect();
        r.notes.push(format!("(c) 4K append+fsync 1t, before/device/after (Fs::io_times): {}", breakdown.join(", ")));
        r.notes.push(match &stat {
            Some(p) => format!(
                "(c) device writes and flushes: deltas of {} over each cell, whoever issued them (the image lives on \
                 the same ext4, so its journal's writes count too, and so does anything else on this disk)",
                p.display()
            ),
            None => "(c) device writes and flushes: no /sys/dev/block stat file for the bench directory's device; \
                     rows left out"
                .into(),
        });
    }
    if let Some(version) = &apps_version {
        type Figure = fn(&AppsAcc) -> &Vec<f64>;
        let rows: [(&str, Figure); 3] =
            [("fillsync", |a| &a.fillsync), ("fillseq", |a| &a.fillseq), ("readrandom cold", |a| &a.cold)];
        for (what, get) in rows {
            let cells: Vec<(&str, f64)> =
                apps_cols.iter().map(|col| (col.name(), median(get(&d[col]).clone()))).collect();
            r.row(&format!("(d) db_bench {what}"), "ops/s", false, &cells);
        }
        // The share of cold lookups that find their block in no cache: one 4 KiB block
        // per lookup, uniform over the SSTs' blocks, each block read once.
        let blocks = (d.values().map(|a| a.sst_bytes).max().unwrap_or(0) / PAGE).max(1) as f64;
        let first = blocks * (1.0 - (-(apps.reads as f64) / blocks).exp()) / apps.reads as f64;
        r.notes.push(format!(
            "(d) db_bench {version}: per cell fillsync --num={} (that many writes with sync=1, a fresh db), fillseq \
             --num={} (16 B keys, 100 B values; {:.0} MiB of SSTs), then the file system unmounted (ext4: synced), \
             the kernel's caches dropped (echo 3 > /proc/sys/vm/drop_caches) and a fresh mount (an empty engine \
             cache) running readrandom --reads={} --use_existing_db=1 (about {:.0}% of the lookups read a block no \
             earlier one did); pwfs through a FUSE mount of the image (kernel cache write-through) or, in the \
             +shim columns, the same mount with db_bench under the LD_PRELOAD shim; ext4 a directory beside it; \
             common flags: {}",
            apps.syncs,
            apps.fill,
            blocks * PAGE as f64 / MIB as f64,
            apps.reads,
            first * 100.0,
            db_bench_flags(o.seed).join(" ")
        ));
        let warm: Vec<String> =
            apps_cols.iter().map(|col| format!("{} {:.0}", col.name(), median(d[col].warm.clone()))).collect();
        r.notes.push(format!(
            "(d) readrandom warm, for comparison (the same lookups again right after the cold run, on the same \
             mount: the kernel's page cache holds their blocks): {} ops/s",
            warm.join(", ")
        ));
    }
    r.target("Async no slower than Sync", "(a) 4K read p50", "async", "sync", Some(1.0), None);
    // An append commits at every fsync (its size changes); an overwrite within one
    // tick of the coarse clock commits nothing, so the overlapped commit shows here.
    let row = "(c) 4K append+fsync 1t p50";
    if r.rows.iter().any(|x| x.name == row) {
        // Strictly faster: Report::target's bounds are inclusive.
        let ratio = r.value(row, "async") / r.value(row, "sync");
        r.targets.push((format!("Async faster than Sync ({row}: async/sync)"), ratio, "< 1".into(), ratio < 1.0));
    }
    r.notes.push(
        "pwfs columns trace I/O (Config::trace_io, a process-wide flag once on: two clock reads per request, for \
         the kernel and raw columns' io_uring engine too); ext4-cold is buffered with the kernel's default readahead"
            .into(),
    );
    Ok(r)
}

/// Grouped bars of the report's p50 latencies: cold reads by size (part a) and
/// write+fsync at one thread (part c), and db_bench's ops/s relative to Sync (part d),
/// one bar per column that has the row. Empty panels (parts not run) are left out.
pub fn plot(r: &Report) -> String {
    let colors = ["#888888", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#ff7f0e", "#d62728", "#17becf", "#bcbd22"];
    let panels: [(&str, Vec<(String, String)>); 3] = [
        (
            "(a) cold read at queue depth 1, p50 latency (us)",
            [4, 8, 16, 32, 64, 128].iter().map(|k| (format!("(a) {k}K read p50"), format!("{k} KiB"))).collect(),
        ),
        (
            "(c) write + fsync, one thread, p50 latency (us)",
            [("4K overwrite", "4 KiB overwrite"), ("4K append", "4 KiB append"), ("64B append", "64 B append")]
                .iter()
                .map(|(k, l)| (format!("(c) {k}+fsync 1t p50"), l.to_string()))
                .collect(),
        ),
        (
            "(d) db_bench through the mount and the shim, ops/s relative to sync",
            ["fillsync", "fillseq", "readrandom cold"]
                .iter()
                .map(|k| (format!("(d) db_bench {k}"), k.to_string()))
                .collect(),
        ),
    ];
    // Part (d)'s figures are ops/s that differ tenfold between columns: shown as
    // ratios to the sync column's.
    let value = |name: &str, col: &str| {
        if name.starts_with("(d)") {
            r.value(name, col) / r.value(name, Col::Sync.name())
        } else {
            r.value(name, col)
        }
    };
    let unit = |name: &str| if name.starts_with("(d)") { "x sync" } else { "us" };
    let (pw, ph, pad) = (620.0, 220.0, 50.0);
    let shown: Vec<&(&str, Vec<(String, String)>)> =
        panels.iter().filter(|(_, rows)| rows.iter().any(|(n, _)| r.rows.iter().any(|x| &x.name == n))).collect();
    let height = shown.len() as f64 * (ph + pad + 20.0) + 80.0;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{height}' font-family='sans-serif' font-size='11'>\n",
        pw + 2.0 * pad
    );
    for (k, (title, rows)) in shown.iter().enumerate() {
        let y0 = 30.0 + k as f64 * (ph + pad + 20.0);
        let max = rows
            .iter()
            .flat_map(|(n, _)| r.columns.iter().map(move |c| value(n, c)))
            .filter(|v| v.is_finite())
            .fold(1.0f64, f64::max);
        s += &format!("<text x='{pad}' y='{}' font-size='13' font-weight='bold'>{title}</text>\n", y0 - 8.0);
        s += &format!("<rect x='{pad}' y='{y0}' width='{pw}' height='{ph}' fill='none' stroke='#ccc'/>\n");
        for tick in 0..=4 {
            let v = max * tick as f64 / 4.0;
            let y = y0 + ph - ph * tick as f64 / 4.0;
            let digits = if max < 20.0 { 1 } else { 0 };
            s += &format!("<text x='{}' y='{}' text-anchor='end'>{v:.digits$}</text>\n", pad - 4.0, y + 4.0);
        }
        let group = pw / rows.len() as f64;
        for (j, (name, label)) in rows.iter().enumerate() {
            let cols: Vec<(usize, f64)> = r
                .columns
                .iter()
                .enumerate()
                .map(|(c, col)| (c, value(name, col)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            if cols.is_empty() {
                continue;
            }
            let bw = group * 0.8 / r.columns.len() as f64;
            for (c, v) in cols {
                let h = ph * v / max;
                let x = pad + j as f64 * group + group * 0.1 + c as f64 * bw;
                s += &format!(
                    "<rect x='{x:.1}' y='{:.1}' width='{:.1}' height='{h:.1}' fill='{}'><title>{} {label}: {v:.2} {}</title></rect>\n",
                    y0 + ph - h,
                    bw - 1.0,
                    colors[c % colors.len()],
                    r.columns[c],
                    unit(name)
                );
            }
            s += &format!(
                "<text x='{:.1}' y='{}' text-anchor='middle'>{label}</text>\n",
                pad + j as f64 * group + group / 2.0,
                y0 + ph + 14.0
            );
        }
    }
    for (c, name) in r.columns.iter().enumerate() {
        // Legend: seven to a line.
        let (x, y) = (pad + (c % 7) as f64 * 95.0, height - 40.0 + (c / 7) as f64 * 18.0);
        s += &format!(
            "<rect x='{x}' y='{y}' width='10' height='10' fill='{}'/><text x='{}' y='{}'>{name}</text>\n",
            colors[c % colors.len()],
            x + 14.0,
            y + 9.0
        );
    }
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke run fills every cell, states both targets, and records the device.
    #[test]
    fn smoke_run_fills_the_table() {
        let _one_at_a_time = crate::smoke_lock();
        let dir = std::env::temp_dir().join(format!("pwfs-bench-aios-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        // A device without a volatile write cache gets no flushes: zero is a figure.
        let mut filled = r.clone();
        filled.rows.retain(|row| !row.name.ends_with("device flushes"));
        filled.check_filled().unwrap();
        for row in r.rows.iter().filter(|row| row.name.ends_with("device flushes")) {
            assert!(row.values.values().all(|v| v.is_finite() && *v >= 0.0), "{row:?}");
        }
        let svg = plot(&r);
        assert!(svg.starts_with("<svg") && svg.contains("128 KiB") && svg.contains("64 B append"));
        assert!(svg.contains("async+poll") && svg.matches("<rect").count() > 6 * 6 + 3 * 4);
        assert_eq!(r.columns.len(), 7);
        assert_eq!(r.targets.len(), 2);
        for kib in SIZES_KIB {
            assert_eq!(r.rows.iter().find(|x| x.name == format!("(a) {kib}K read p50")).unwrap().values.len(), 6);
        }
        for what in ["before", "device", "after"] {
            let row = r.rows.iter().find(|x| x.name == format!("(a) 4K {what}")).unwrap();
            assert_eq!(row.values.len(), 3, "{row:?}");
        }
        for name in ["(b) 4K read, 4 threads", "(c) 64B append+fsync 4t p99"] {
            assert!(r.rows.iter().any(|x| x.name == name), "{name}");
        }
        // Part (d) (db_bench) is never run by the smoke run, and says so.
        assert!(!r.rows.iter().any(|x| x.name.starts_with("(d)")));
        assert!(r.notes.iter().any(|n| n == "(d) skipped: not part of the smoke run"), "{:?}", r.notes);
        let j = r.json();
        assert!(j["device"]["read_4k_us"].as_f64().is_some_and(|v| v > 0.0), "{j}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
