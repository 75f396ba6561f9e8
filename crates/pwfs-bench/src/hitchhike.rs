//! `pwfs bench hitchhike`: small synchronous writes (mechanism 3, hitchhiking: the
//! change rides as an XOR+LZ4 delta in the journal's commit block, one device write
//! per fsync) against the same engine with hitchhiking off and against ext4, in one run.
//!
//! Columns: `hitchhike on` and `hitchhike off` (pwfs through its Rust API, `Config`'s
//! defaults but for `hitchhike`, the asynchronous stack; a fresh mount of one image per
//! cell, so both columns run on the same layout and start with an empty cache and
//! buffer), `ext4` (a directory in the bench directory: the disk's own ext4) and
//! `ext4 fast_commit` (`mkfs.ext4 -O fast_commit` on a loop device over an image file
//! in the bench directory, mounted for the run; left out, with the reason in a note,
//! where that cannot be set up). For the `append` part only, `shim on` and `shim off`:
//! an unmodified C program (`apps/append_sync.c`, compiled with `cc`: write(2) and
//! fsync(2)) on a FUSE mount of the same image served by this process, hitchhiking on
//! resp. off for that mount, run under `LD_PRELOAD=libpwfs_preload.so` (the shim;
//! `cargo build --release -p pwfs-preload`, found through `$PWFS_PRELOAD` or beside the
//! running `pwfs`); left out, with the reason, without root and /dev/fuse, the library
//! or `cc`. The program waits for the bench around its timed operations, so that the
//! counters are read exactly around them as in the other columns; the shim's request
//! counter shows that it carried the calls.
//!
//! Parts (`--only append,overwrite,varmail`):
//! - `append`: appends of 64 B to 4 KiB to one file, fsync after each (the paper's
//!   workload: Filebench's filemicro_writesync), with the recognition ratio of the
//!   engine (small writes carried as deltas over pages its fsyncs wrote,
//!   `HitchhikeStats::hitchhiked / sync_pages`) beside the paper's Table 2;
//! - `overwrite`: random overwrites of the same sizes (at offsets aligned to the
//!   size) in a 16 MiB file preallocated afresh for every cell (fallocate), fdatasync
//!   after each;
//! - `varmail`: 2 threads with 16 files each, appends of 64 B to 2 KiB at random,
//!   each followed by fsync; one operation in 16 first deletes its file and creates it
//!   again.
//!
//! Every cell runs `rounds` times, the order of the columns rotating from one round to
//! the next, so that drift of this shared machine falls on all of them; ops/s is the
//! median over rounds, latencies are the percentiles of every operation of every
//! round. Written data is random (incompressible, as a delta of it is). The device's
//! writes, bytes written and flushes per operation are deltas of the disk's
//! /sys/block stat file over each measured phase (medians over rounds), whoever
//! issued them.

use crate::programs::Place;
use crate::{median, percentiles, DeviceProbe, Opts, Report};
use pwfs::{Config, Fs, HitchhikeStats, MkfsOptions, OpenOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::io::{BufRead, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::Instant;

const MIB: u64 = 1 << 20;

/// Sizes of the appends and overwrites, in bytes.
pub const SIZES: [usize; 7] = [64, 128, 256, 512, 1024, 2048, 4096];
/// The parts `--only` takes.
pub const PARTS: [&str; 3] = ["append", "overwrite", "varmail"];
/// The paper's Table 2 (recognition ratio of small writes, %), by write size.
pub const PAPER: [(usize, f64); 6] = [(64, 98.5), (128, 97.0), (256, 93.8), (512, 87.6), (1024, 75.1), (2048, 50.0)];
/// The column of the paper's figures (recognition rows only).
pub const PAPER_COLUMN: &str = "paper";
/// The file of the overwrites.
const OVERWRITE_BYTES: u64 = 16 * MIB;
/// Varmail: threads, files per thread, size range of an append, one delete+create in.
const VARMAIL_THREADS: usize = 2;
const VARMAIL_FILES: usize = 16;
const VARMAIL_SIZES: std::ops::RangeInclusive<usize> = 64..=2048;
const VARMAIL_DELETE_ONE_IN: u32 = 16;
/// Untimed write+fsync pairs at the start of every cell (a fresh mount's first
/// requests set up its rings; the file's creation commits).
const WARM: usize = 4;
/// The journal of the pwfs image, in 4 KiB blocks: 64 MiB, what mkfs.ext4 gives a
/// 1 GiB device, so that the hitchhiking buffer is its configured size (it is also
/// bounded by a sixteenth of the journal) rather than the default journal's.
const JOURNAL_BLOCKS: u64 = 16384;
/// The shim columns' program (`append_sync PATH SIZE COUNT [LATFILE]`).
const APPEND_SYNC_C: &str = include_str!("apps/append_sync.c");

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Col {
    On,
    Off,
    ShimOn,
    ShimOff,
    Ext4,
    Ext4Fc,
}

impl Col {
    const ALL: [Col; 6] = [Col::On, Col::Off, Col::ShimOn, Col::ShimOff, Col::Ext4, Col::Ext4Fc];

    fn name(self) -> &'static str {
        match self {
            Col::On => "hitchhike on",
            Col::Off => "hitchhike off",
            Col::ShimOn => "shim on",
            Col::ShimOff => "shim off",
            Col::Ext4 => "ext4",
            Col::Ext4Fc => "ext4 fast_commit",
        }
    }

    /// A C program under the shim on a FUSE mount (the append part only).
    fn shim(self) -> bool {
        matches!(self, Col::ShimOn | Col::ShimOff)
    }

    /// The columns that run `work`.
    fn of(cols: &[Col], work: Work) -> Vec<Col> {
        cols.iter().copied().filter(|c| !c.shim() || matches!(work, Work::Append(_))).collect()
    }
}

/// The mount of a pwfs column.
fn pwfs_config(hitchhike: bool) -> Config {
    Config { hitchhike, ..Default::default() }
}

/// Writes completed, sectors written and flushes completed of a block device: fields
/// 5, 7 and 16 (1-based) of its stat file (Documentation/block/stat.rst: field 15 is
/// the time spent on discards; the flush fields, 16 and 17, came with Linux 5.5).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    writes: u64,
    sectors: u64,
    flushes: Option<u64>,
}

impl Counts {
    fn read(stat: &Path) -> Option<Counts> {
        let s = std::fs::read_to_string(stat).ok()?;
        let f: Vec<Option<u64>> = s.split_whitespace().map(|x| x.parse().ok()).collect();
        Some(Counts {
            writes: f.get(4).copied()??,
            sectors: f.get(6).copied()??,
            flushes: f.get(15).copied().flatten(),
        })
    }

    fn since(self, before: Counts) -> Counts {
        Counts {
            writes: self.writes.saturating_sub(before.writes),
            sectors: self.sectors.saturating_sub(before.sectors),
            flushes: self.flushes.zip(before.flushes).map(|(a, b)| a.saturating_sub(b)),
        }
    }

    fn add(self, d: Counts) -> Counts {
        Counts {
            writes: self.writes + d.writes,
            sectors: self.sectors + d.sectors,
            flushes: self.flushes.zip(d.flushes).map(|(a, b)| a + b),
        }
    }
}

/// The stat file of the block device (or partition) holding `dir`.
fn disk_stat_path(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let d = std::fs::metadata(dir).ok()?.dev();
    // glibc's encoding of dev_t (gnu_dev_major / gnu_dev_minor).
    let major = ((d >> 8) & 0xfff) | ((d >> 32) & !0xfff);
    let minor = (d & 0xff) | ((d >> 12) & !0xff);
    let p = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    p.exists().then_some(p)
}

fn hh_since(a: HitchhikeStats, b: HitchhikeStats) -> HitchhikeStats {
    HitchhikeStats {
        sync_pages: a.sync_pages - b.sync_pages,
        hitchhiked: a.hitchhiked - b.hitchhiked,
        meta_deltas: a.meta_deltas - b.meta_deltas,
        data_images: a.data_images - b.data_images,
        bytes_saved: a.bytes_saved - b.bytes_saved,
        commit_only: a.commit_only - b.commit_only,
        sync_commits: a.sync_commits - b.sync_commits,
        retired: a.retired - b.retired,
        buffered: a.buffered,
        ..a
    }
}

fn hh_add(a: HitchhikeStats, d: HitchhikeStats) -> HitchhikeStats {
    HitchhikeStats {
        sync_pages: a.sync_pages + d.sync_pages,
        hitchhiked: a.hitchhiked + d.hitchhiked,
        meta_deltas: a.meta_deltas + d.meta_deltas,
        data_images: a.data_images + d.data_images,
        bytes_saved: a.bytes_saved + d.bytes_saved,
        commit_only: a.commit_only + d.commit_only,
        sync_commits: a.sync_commits + d.sync_commits,
        retired: a.retired + d.retired,
        buffered: d.buffered,
        ..d
    }
}

/// The counters at one moment: the disk's, the loop device's (ext4 fast_commit), the
/// engine's hitchhiking (pwfs) and the requests the shim's socket answered (shim).
#[derive(Clone, Copy, Default)]
struct Snap {
    disk: Option<Counts>,
    lo: Option<Counts>,
    hh: Option<HitchhikeStats>,
    shim: Option<u64>,
}

/// One measured phase.
struct Cell {
    lat: Vec<f64>,
    ops: u64,
    secs: f64,
    disk: Option<Counts>,
    lo: Option<Counts>,
    hh: Option<HitchhikeStats>,
    shim: Option<u64>,
}

impl Cell {
    fn new(lat: Vec<f64>, secs: f64, before: Snap, after: Snap) -> Cell {
        let since = |a: Option<Counts>, b: Option<Counts>| Some(a?.since(b?));
        Cell {
            ops: lat.len() as u64,
            lat,
            secs,
            disk: since(after.disk, before.disk),
            lo: since(after.lo, before.lo),
            hh: after.hh.zip(before.hh).map(|(a, b)| hh_since(a, b)),
            shim: after.shim.zip(before.shim).map(|(a, b)| a.saturating_sub(b)),
        }
    }
}

/// A column's cells of one row, over the rounds.
#[derive(Default)]
struct Acc {
    rates: Vec<f64>,
    lat: Vec<f64>,
    ops: u64,
    /// The disk's counts of each round, with its operations.
    disk: Vec<(u64, Option<Counts>)>,
    /// The loop device's, summed over the rounds.
    lo: Option<Counts>,
    hh: Option<HitchhikeStats>,
    /// Requests the shim's socket answered, summed over the rounds.
    shim: Option<u64>,
}

impl Acc {
    fn add(&mut self, c: Cell) {
        let first = self.ops == 0;
        self.rates.push(c.ops as f64 / c.secs);
        self.ops += c.ops;
        self.lat.extend(c.lat);
        self.disk.push((c.ops, c.disk));
        self.lo = if first { c.lo } else { self.lo.zip(c.lo).map(|(a, d)| a.add(d)) };
        self.hh = if first { c.hh } else { self.hh.zip(c.hh).map(|(a, d)| hh_add(a, d)) };
        self.shim = if first { c.shim } else { self.shim.zip(c.shim).map(|(a, d)| a + d) };
    }

    /// A disk count per operation: the median over rounds (a burst of someone else's
    /// writes to the disk during one round does not move it).
    fn per_op(&self, get: fn(Counts) -> Option<u64>) -> Option<f64> {
        let per_round = self.disk.iter().map(|(ops, c)| Some(get((*c)?)? as f64 / *ops as f64));
        Some(median(per_round.collect::<Option<Vec<f64>>>()?))
    }

    /// Hitchhiked pages over the pages the fsyncs wrote, %.
    fn recognition(&self) -> Option<f64> {
        let h = self.hh?;
        (h.sync_pages > 0).then(|| 100.0 * h.hitchhiked as f64 / h.sync_pages as f64)
    }
}

/// A file system under test: a pwfs mount, or a directory of the kernel's.
#[derive(Clone, Copy)]
enum Fsys<'a> {
    Pwfs(&'a Fs),
    Kernel(&'a Path),
}

/// A file open for reading and writing.
enum WFile {
    Pwfs(pwfs::File),
    Kernel(std::fs::File),
}

impl WFile {
    fn write(&self, data: &[u8], off: u64) -> R<()> {
        match self {
            WFile::Pwfs(f) => {
                let n = f.write_at(data, off).map_err(err("write"))?;
                if n != data.len() {
                    return Err(format!("short write: {n} of {}", data.len()));
                }
                Ok(())
            }
            WFile::Kernel(f) => f.write_all_at(data, off).map_err(err("pwrite")),
        }
    }

    /// fsync, or fdatasync if `data_only`.
    fn sync(&self, data_only: bool) -> R<()> {
        match (self, data_only) {
            (WFile::Pwfs(f), false) => f.sync_all().map_err(err("fsync")),
            (WFile::Pwfs(f), true) => f.sync_data().map_err(err("fdatasync")),
            (WFile::Kernel(f), false) => f.sync_all().map_err(err("fsync")),
            (WFile::Kernel(f), true) => f.sync_data().map_err(err("fdatasync")),
        }
    }

    /// fallocate(2) of `len` bytes from offset 0 (mode 0: the size grows to it).
    fn preallocate(&self, len: u64) -> R<()> {
        match self {
            WFile::Pwfs(f) => f.allocate(0, 0, len).map_err(err("fallocate")),
            WFile::Kernel(f) => {
                use std::os::unix::io::AsRawFd;
                // SAFETY: plain syscall on an fd we own.
                if unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len as libc::off_t) } != 0 {
                    return Err(format!("fallocate: {}", std::io::Error::last_os_error()));
                }
                Ok(())
            }
        }
    }
}

impl Fsys<'_> {
    fn create(&self, name: &str) -> R<WFile> {
        Ok(match self {
            Fsys::Pwfs(fs) => WFile::Pwfs(
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(fs, format!("/{name}"))
                    .map_err(err("create"))?,
            ),
            Fsys::Kernel(dir) => WFile::Kernel(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(dir.join(name))
                    .map_err(err("create"))?,
            ),
        })
    }

    fn remove(&self, name: &str) -> R<()> {
        match self {
            Fsys::Pwfs(fs) => fs.remove_file(format!("/{name}")).map_err(err("unlink")),
            Fsys::Kernel(dir) => std::fs::remove_file(dir.join(name)).map_err(err("unlink")),
        }
    }

    fn mkdir(&self, name: &str) -> R<()> {
        match self {
            Fsys::Pwfs(fs) => fs.create_dir(format!("/{name}"), 0o755).map(|_| ()).map_err(err("mkdir")),
            Fsys::Kernel(dir) => std::fs::create_dir(dir.join(name)).map_err(err("mkdir")),
        }
    }

    fn rmdir(&self, name: &str) -> R<()> {
        match self {
            Fsys::Pwfs(fs) => fs.remove_dir(format!("/{name}")).map_err(err("rmdir")),
            Fsys::Kernel(dir) => std::fs::remove_dir(dir.join(name)).map_err(err("rmdir")),
        }
    }

    /// Make `files` and the names made so far durable, before the clock starts.
    fn settle(&self, files: &[&WFile], dir: &str) -> R<()> {
        match self {
            Fsys::Pwfs(fs) => fs.sync().map_err(err("sync")),
            Fsys::Kernel(base) => {
                for f in files {
                    f.sync(false)?;
                }
                std::fs::File::open(base.join(dir)).and_then(|d| d.sync_all()).map_err(err("fsync the directory"))
            }
        }
    }
}

/// Appends of `size` bytes to a new file, fsync after each: `n` measured.
fn append(d: Fsys<'_>, size: usize, n: usize, seed: u64, snap: &dyn Fn() -> Snap) -> R<Cell> {
    const NAME: &str = "append.dat";
    let f = d.create(NAME)?;
    d.settle(&[&f], "")?;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; size];
    let mut end = 0u64;
    for _ in 0..WARM {
        rng.fill(&mut buf[..]);
        f.write(&buf, end)?;
        f.sync(false)?;
        end += size as u64;
    }
    let mut lat = Vec::with_capacity(n);
    let before = snap();
    let start = Instant::now();
    for _ in 0..n {
        rng.fill(&mut buf[..]);
        let t = Instant::now();
        f.write(&buf, end)?;
        f.sync(false)?;
        lat.push(us(t));
        end += size as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    let after = snap();
    drop(f);
    d.remove(NAME)?;
    Ok(Cell::new(lat, secs, before, after))
}

/// Overwrites of `size` bytes at random offsets (aligned to the size) in a file
/// preallocated afresh, fdatasync after each: `n` measured.
fn overwrite(d: Fsys<'_>, size: usize, n: usize, seed: u64, snap: &dyn Fn() -> Snap) -> R<Cell> {
    const NAME: &str = "overwrite.dat";
    let f = d.create(NAME)?;
    f.preallocate(OVERWRITE_BYTES)?;
    d.settle(&[&f], "")?;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; size];
    let slots = OVERWRITE_BYTES / size as u64;
    let one = |rng: &mut SmallRng, buf: &mut Vec<u8>| {
        rng.fill(&mut buf[..]);
        rng.gen_range(0..slots) * size as u64
    };
    for _ in 0..WARM {
        let off = one(&mut rng, &mut buf);
        f.write(&buf, off)?;
        f.sync(true)?;
    }
    let mut lat = Vec::with_capacity(n);
    let before = snap();
    let start = Instant::now();
    for _ in 0..n {
        let off = one(&mut rng, &mut buf);
        let t = Instant::now();
        f.write(&buf, off)?;
        f.sync(true)?;
        lat.push(us(t));
    }
    let secs = start.elapsed().as_secs_f64();
    let after = snap();
    drop(f);
    d.remove(NAME)?;
    Ok(Cell::new(lat, secs, before, after))
}

/// One varmail thread: its directory and files, made durable before the clock.
fn varmail_setup(d: Fsys<'_>, t: usize) -> R<(String, Vec<WFile>)> {
    let dir = format!("varmail{t}");
    d.mkdir(&dir)?;
    let files = (0..VARMAIL_FILES).map(|i| d.create(&format!("{dir}/f{i}"))).collect::<R<Vec<_>>>()?;
    let refs: Vec<&WFile> = files.iter().collect();
    d.settle(&refs, &dir)?;
    Ok((dir, files))
}

/// `n` operations of one varmail thread: latencies, and when it started and ended.
fn varmail_thread(d: Fsys<'_>, dir: &str, files: &mut [WFile], n: usize, seed: u64) -> R<(Vec<f64>, Instant, Instant)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut ends = vec![0u64; files.len()];
    let mut buf = vec![0u8; *VARMAIL_SIZES.end()];
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let i = rng.gen_range(0..files.len());
        let len = rng.gen_range(VARMAIL_SIZES);
        let recreate = rng.gen_ratio(1, VARMAIL_DELETE_ONE_IN);
        rng.fill(&mut buf[..len]);
        let t = Instant::now();
        if recreate {
            let name = format!("{dir}/f{i}");
            d.remove(&name)?;
            files[i] = d.create(&name)?;
            ends[i] = 0;
        }
        files[i].write(&buf[..len], ends[i])?;
        files[i].sync(false)?;
        lat.push(us(t));
        ends[i] += len as u64;
    }
    Ok((lat, start, Instant::now()))
}

/// Varmail: `n` operations per thread, all threads at once.
fn varmail(d: Fsys<'_>, n: usize, seed: u64, snap: &dyn Fn() -> Snap) -> R<Cell> {
    let (ready, go) = (Barrier::new(VARMAIL_THREADS + 1), Barrier::new(VARMAIL_THREADS + 1));
    let mut before = Snap::default();
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..VARMAIL_THREADS)
            .map(|t| {
                let (ready, go) = (&ready, &go);
                s.spawn(move || {
                    let set = varmail_setup(d, t);
                    ready.wait();
                    go.wait();
                    let (dir, mut files) = set?;
                    let r = varmail_thread(d, &dir, &mut files, n, seed ^ ((t as u64 + 1) * 0x9e37_79b9));
                    Ok::<_, String>((r, dir, files))
                })
            })
            .collect();
        ready.wait();
        before = snap();
        go.wait();
        handles.into_iter().map(|h| h.join().map_err(|_| "a varmail thread panicked".to_string())).collect::<Vec<_>>()
    });
    let after = snap();
    let (mut lat, mut first, mut last) = (Vec::new(), None::<Instant>, None::<Instant>);
    let mut cleanup = Vec::new();
    let mut failed = None;
    for r in results {
        match r.and_then(|x| x) {
            Ok((r, dir, files)) => {
                cleanup.push((dir, files));
                match r {
                    Ok((l, a, b)) => {
                        lat.extend(l);
                        first = Some(first.map_or(a, |f| f.min(a)));
                        last = Some(last.map_or(b, |l| l.max(b)));
                    }
                    Err(e) => failed = Some(e),
                }
            }
            Err(e) => failed = Some(e),
        }
    }
    for (dir, files) in cleanup {
        drop(files);
        for i in 0..VARMAIL_FILES {
            d.remove(&format!("{dir}/f{i}"))?;
        }
        d.rmdir(&dir)?;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let secs = match (first, last) {
        (Some(f), Some(l)) => l.saturating_duration_since(f).as_secs_f64(),
        _ => f64::NAN,
    };
    Ok(Cell::new(lat, secs, before, after))
}

/// How a flush shows in the disk's counters: fdatasync of a file with nothing to write,
/// `PROBE_FLUSHES` times (the kernel sends an empty write with a preflush, which the stat
/// file counts as a write as well as a flush). Writes, bytes and flushes per fdatasync;
/// None without a stat file.
fn flush_probe(dir: &Path, disk: Option<&Path>) -> R<Option<PerOp>> {
    const PROBE_FLUSHES: u64 = 32;
    let path = dir.join("hitchhike-flush-probe.dat");
    zero_file(&path, MIB)?;
    let f = std::fs::File::open(&path).map_err(err("open the probe file"))?;
    let before = disk.and_then(Counts::read);
    for _ in 0..PROBE_FLUSHES {
        f.sync_data().map_err(err("fdatasync"))?;
    }
    let after = disk.and_then(Counts::read);
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(after.zip(before).map(|(a, b)| {
        let d = a.since(b);
        let n = PROBE_FLUSHES as f64;
        PerOp {
            writes: d.writes as f64 / n,
            bytes: (d.sectors * 512) as f64 / n,
            flushes: d.flushes.unwrap_or(0) as f64 / n,
        }
    }))
}

#[derive(Clone, Copy)]
struct PerOp {
    writes: f64,
    bytes: f64,
    flushes: f64,
}

/// What one cell runs.
#[derive(Clone, Copy)]
enum Work {
    Append(usize),
    Overwrite(usize),
    Varmail,
}

impl Work {
    fn part(self) -> &'static str {
        match self {
            Work::Append(_) => "append",
            Work::Overwrite(_) => "overwrite",
            Work::Varmail => "varmail",
        }
    }

    /// The row name prefix: "append 64 B", "varmail".
    fn row(self) -> String {
        match self {
            Work::Append(s) | Work::Overwrite(s) => format!("{} {s} B", self.part()),
            Work::Varmail => "varmail".into(),
        }
    }

    fn run(self, d: Fsys<'_>, n: usize, seed: u64, snap: &dyn Fn() -> Snap) -> R<Cell> {
        match self {
            Work::Append(size) => append(d, size, n, seed, snap),
            Work::Overwrite(size) => overwrite(d, size, n, seed, snap),
            Work::Varmail => varmail(d, n, seed, snap),
        }
    }
}

/// An ext4 with fast commits on a loop device over an image file, mounted; unmounted,
/// detached and removed when dropped (also when a step of setting it up failed).
struct LoopFs {
    image: PathBuf,
    mnt: PathBuf,
    dev: Option<String>,
    mounted: bool,
    /// How it was set up, for the notes.
    how: String,
}

/// Run a program; its standard output, or why it failed.
fn command(prog: &str, args: &[&str]) -> R<String> {
    let out = Command::new(prog).args(args).output().map_err(|e| format!("{prog}: {e}"))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(format!("{prog} {}: {} {why}", args.join(" "), out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A file of `bytes` zeros, written through (the host then has no unwritten extents
/// in it, whose conversion would add journal writes to every first write).
fn zero_file(path: &Path, bytes: u64) -> R<()> {
    let mut f = std::fs::File::create(path).map_err(err("create image"))?;
    let chunk = vec![0u8; MIB as usize];
    for _ in 0..bytes / MIB {
        f.write_all(&chunk).map_err(err("fill image"))?;
    }
    f.sync_all().map_err(err("sync image"))
}

impl LoopFs {
    fn make(dir: &Path, bytes: u64) -> R<LoopFs> {
        let mut l = LoopFs {
            image: dir.join("hitchhike-fc.img"),
            mnt: dir.join("hitchhike-fc-mnt"),
            dev: None,
            mounted: false,
            how: String::new(),
        };
        zero_file(&l.image, bytes)?;
        let image = l.image.to_string_lossy().into_owned();
        // Direct I/O on the image where the loop driver takes it: no second page cache.
        let (dev, direct) = match command("losetup", &["-f", "--show", "--direct-io=on", &image]) {
            Ok(d) => (d, true),
            Err(_) => (command("losetup", &["-f", "--show", &image])?, false),
        };
        let dev = dev.trim().to_string();
        l.dev = Some(dev.clone());
        // 4 KiB blocks whatever the size (mke2fs gives a small file system 1 KiB ones).
        command("mkfs.ext4", &["-q", "-F", "-b", "4096", "-O", "fast_commit", &dev])?;
        std::fs::create_dir_all(&l.mnt).map_err(err("mount point"))?;
        command("mount", &["-t", "ext4", &dev, &l.mnt.to_string_lossy()])?;
        l.mounted = true;
        let journal = command("dumpe2fs", &["-h", &dev])
            .ok()
            .and_then(|o| {
                let line =
                    o.lines().find(|x| x.starts_with("Total journal size:") || x.starts_with("Journal size:"))?;
                Some(line.split_once(':')?.1.trim().to_string())
            })
            .unwrap_or_else(|| "?".into());
        l.how = format!(
            "mkfs.ext4 -b 4096 -O fast_commit on {dev} (losetup{} over a {} MiB image in the bench directory, \
             journal {journal}), default mount options",
            if direct { " --direct-io=on" } else { ", buffered" },
            bytes / MIB
        );
        Ok(l)
    }

    /// The loop device's own stat file: what ext4 itself issued.
    fn stat(&self) -> Option<PathBuf> {
        let name = Path::new(self.dev.as_ref()?).file_name()?.to_string_lossy().into_owned();
        Some(PathBuf::from(format!("/sys/block/{name}/stat")))
    }

    /// ext4's fast commit counters (/proc/fs/ext4/loopN/fc_info): "N commits, M ineligible".
    fn fc_info(&self) -> Option<String> {
        let name = Path::new(self.dev.as_ref()?).file_name()?.to_string_lossy().into_owned();
        let s = std::fs::read_to_string(format!("/proc/fs/ext4/{name}/fc_info")).ok()?;
        let lines: Vec<&str> = s.lines().skip(1).take(2).map(str::trim).collect();
        Some(lines.join(", "))
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        if self.mounted {
            let mnt = self.mnt.to_string_lossy().into_owned();
            // A file just closed can keep it busy for a moment.
            for _ in 0..20 {
                if command("umount", &[&mnt]).is_ok() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        if let Some(dev) = &self.dev {
            let _ = command("losetup", &["-d", dev]);
        }
        let _ = std::fs::remove_dir(&self.mnt);
        let _ = std::fs::remove_file(&self.image);
    }
}

/// Operations per size per column over all rounds, and the rounds (odd, so that the
/// median is a round's figure): 2000 in 5 rounds in a full run, 300 in 3 in a quick
/// one, 30 in 3 in a smoke run (`Opts::ops` is 4000, 2000 and 100 there). Varmail
/// runs as many per thread.
fn counts(o: &Opts) -> (usize, usize) {
    match o.ops {
        n if n <= 100 => (30, 3),
        n if n <= 2000 => (300, 3),
        _ => (2000, 5),
    }
}

/// The images' size: the pwfs image and the loop device's (smaller in a smoke run).
fn image_bytes(o: &Opts) -> u64 {
    if o.ops <= 100 {
        256 * MIB
    } else {
        1024 * MIB
    }
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    for part in &o.only {
        if !PARTS.contains(&part.as_str()) {
            return Err(format!("unknown part {part:?} of bench hitchhike (known: {})", PARTS.join(", ")));
        }
    }
    let wanted = |p: &str| o.only.is_empty() || o.only.iter().any(|x| x == p);
    std::fs::create_dir_all(&o.dir).map_err(err("bench dir"))?;
    let device = DeviceProbe::measure(&o.dir);
    let disk = disk_stat_path(&o.dir);
    let (total, rounds) = counts(o);
    let per_cell = (total / rounds).max(1);
    let bytes = image_bytes(o);
    let flush = flush_probe(&o.dir, disk.as_deref())?;
    let image = o.dir.join("hitchhike.img");
    let kdir = o.dir.join("hitchhike-ext4");
    let _ = std::fs::remove_dir_all(&kdir);
    std::fs::create_dir_all(&kdir).map_err(err("ext4 dir"))?;
    progress("preparing the pwfs image");
    zero_file(&image, bytes)?;
    let opts = MkfsOptions { journal_blocks: Some(JOURNAL_BLOCKS), ..Default::default() };
    pwfs::mkfs_image(&image, bytes, &opts).map_err(err("mkfs"))?;
    let hitch_blocks = Config::default().hitchhike_blocks;
    let mut notes = Vec::new();
    progress("setting up ext4 with fast_commit on a loop device");
    let fc = match LoopFs::make(&o.dir, bytes) {
        Ok(l) => Some(l),
        Err(why) => {
            notes.push(format!("ext4 fast_commit column left out: {why}"));
            None
        }
    };
    let shim = if wanted("append") {
        progress("building append_sync for the shim columns");
        match ShimRig::make(&o.dir) {
            Ok(rig) => Some(rig),
            Err(why) => {
                notes.push(format!("shim columns left out: {why}"));
                None
            }
        }
    } else {
        None
    };
    let cols: Vec<Col> = Col::ALL
        .into_iter()
        .filter(|c| *c != Col::Ext4Fc || fc.is_some())
        .filter(|c| !c.shim() || shim.is_some())
        .collect();
    let mut works: Vec<Work> = Vec::new();
    if wanted("append") {
        works.extend(SIZES.map(Work::Append));
    }
    if wanted("overwrite") {
        works.extend(SIZES.map(Work::Overwrite));
    }
    if wanted("varmail") {
        works.push(Work::Varmail);
    }
    let mut acc: std::collections::HashMap<(String, Col), Acc> = Default::default();
    let lo_stat = fc.as_ref().and_then(LoopFs::stat);
    let result = (|| -> R<()> {
        for (wi, work) in works.iter().enumerate() {
            progress(&work.row());
            for round in 0..rounds {
                let seed = o.seed ^ ((wi as u64) << 32) ^ round as u64;
                let mut order = Col::of(&cols, *work);
                let k = order.len();
                order.rotate_left((round + wi) % k);
                for col in order {
                    let cell = run_cell(
                        col,
                        *work,
                        per_cell,
                        seed,
                        &image,
                        &kdir,
                        fc.as_ref(),
                        shim.as_ref(),
                        &disk,
                        &lo_stat,
                    )
                    .map_err(|e| format!("{} {}: {e}", work.row(), col.name()))?;
                    acc.entry((work.row(), col)).or_default().add(cell);
                }
            }
        }
        Ok(())
    })();
    let fc_info = fc.as_ref().and_then(LoopFs::fc_info);
    let fc_how = fc.as_ref().map(|l| l.how.clone());
    drop(fc);
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_dir_all(&kdir);
    if let Some(rig) = &shim {
        let _ = std::fs::remove_dir_all(&rig.scratch);
        let _ = std::fs::remove_dir(&rig.mnt);
    }
    result?;

    let mut columns: Vec<String> = cols.iter().map(|c| c.name().to_string()).collect();
    if wanted("append") {
        columns.push(PAPER_COLUMN.into());
    }
    let mut r = Report {
        title: format!(
            "pwfs bench hitchhike: write+fsync, {per_cell} ops per cell, {rounds} rounds, columns rotated \
             (ops/s and device: median over rounds; latency: over every op)"
        ),
        columns,
        ratio_bases: vec![Col::Off.name().into()],
        device: Some(device),
        notes,
        ..Default::default()
    };
    let parts: Vec<Vec<Work>> = PARTS
        .into_iter()
        .map(|p| works.iter().copied().filter(|w| w.part() == p).collect::<Vec<_>>())
        .filter(|w| !w.is_empty())
        .collect();
    type Figure = fn(&Acc) -> Option<f64>;
    let figures: [(&str, &'static str, bool, Figure); 6] = [
        ("", "ops/s", false, |a| Some(median(a.rates.clone()))),
        (" p50", "us", true, |a| Some(percentiles(a.lat.clone()).0)),
        (" p99", "us", true, |a| Some(percentiles(a.lat.clone()).1)),
        (" device writes", "per op", true, |a| a.per_op(|c| Some(c.writes))),
        (" device bytes", "B/op", true, |a| a.per_op(|c| Some(c.sectors * 512))),
        (" device flushes", "per op", true, |a| a.per_op(|c| c.flushes)),
    ];
    for ws in &parts {
        for (suffix, unit, lower, get) in figures {
            for w in ws {
                let cells: Vec<(&str, f64)> =
                    cols.iter().filter_map(|c| acc.get(&(w.row(), *c)).and_then(get).map(|v| (c.name(), v))).collect();
                if !cells.is_empty() {
                    r.row(&format!("{}{suffix}", w.row()), unit, lower, &cells);
                }
            }
        }
        for w in ws {
            let mut cells: Vec<(&str, f64)> = [Col::On, Col::ShimOn]
                .iter()
                .filter_map(|c| acc.get(&(w.row(), *c)).and_then(Acc::recognition).map(|v| (c.name(), v)))
                .collect();
            if cells.is_empty() {
                continue;
            }
            if let Work::Append(size) = w {
                if let Some((_, p)) = PAPER.iter().find(|(s, _)| s == size) {
                    cells.push((PAPER_COLUMN, *p));
                }
            }
            r.row(&format!("{} recognition", w.row()), "%", false, &cells);
        }
    }

    // Targets.
    let (on, off, ext4, fc) = (Col::On.name(), Col::Off.name(), Col::Ext4.name(), Col::Ext4Fc.name());
    r.target("64 B append, hitchhike on vs off", "append 64 B", on, off, None, Some(1.5));
    r.target("64 B append, hitchhike on vs ext4", "append 64 B", on, ext4, None, Some(2.0));
    if cols.contains(&Col::Ext4Fc) {
        r.target("64 B append, hitchhike on vs ext4 fast_commit", "append 64 B", on, fc, None, Some(1.2));
    }
    if cols.contains(&Col::ShimOn) {
        let (son, soff) = (Col::ShimOn.name(), Col::ShimOff.name());
        r.target("64 B append, shim on vs shim off", "append 64 B", son, soff, None, Some(1.5));
        r.target("64 B append, shim on vs ext4", "append 64 B", son, ext4, None, Some(2.0));
        if cols.contains(&Col::Ext4Fc) {
            r.target("64 B append, shim on vs ext4 fast_commit", "append 64 B", son, fc, None, Some(1.2));
        }
    }
    let row = "append 64 B device writes";
    if r.rows.iter().any(|x| x.name == row) {
        let v = r.value(row, on);
        r.targets.push((format!("device writes per op ({row}: {on})"), v, "<= 1.2".into(), v <= 1.2));
        // The empty writes of its flushes left out (see the note on the flush probe).
        let flushes = r.value("append 64 B device flushes", on);
        if let (Some(p), true) = (flush, flushes.is_finite()) {
            let data = v - flushes * p.writes / p.flushes.max(1.0);
            r.targets.push((
                format!("device writes per op, its flushes' empty writes left out ({row}: {on})"),
                data,
                "<= 1.2".into(),
                data <= 1.2,
            ));
        }
    }
    for (size, _) in PAPER {
        let row = format!("append {size} B recognition");
        // Not where the API column's ratio is undefined (the row is there for the shim's).
        if r.value(&row, on).is_finite() {
            r.target("recognition ratio at least the paper's", &row, on, PAPER_COLUMN, None, Some(1.0));
        }
    }
    for part in ["append", "overwrite"] {
        for size in SIZES {
            r.target(
                "hitchhike on no more than 3% slower than off",
                &format!("{part} {size} B"),
                on,
                off,
                None,
                Some(0.97),
            );
        }
    }

    // Notes.
    // The buffer the mounts had (the engine may bound the configured size).
    let hitch_blocks = acc
        .iter()
        .filter(|((_, c), _)| *c == Col::On || *c == Col::ShimOn)
        .find_map(|(_, a)| a.hh.filter(|h| h.active).map(|h| h.capacity as usize))
        .unwrap_or(hitch_blocks);
    r.notes.push(format!(
        "pwfs columns (the API's and the shim's mounts): Config::default() but for hitchhike (buffer of \
         {hitch_blocks} blocks, stack Async), a fresh mount per cell of one {} MiB image (zero-filled on the host \
         first, journal {} MiB), files removed and the file system synced after each cell, untimed; {WARM} untimed \
         write+fsync pairs start every cell",
        bytes / MIB,
        JOURNAL_BLOCKS * 4096 / MIB
    ));
    r.notes.push(format!(
        "ext4: files in {} (the host's ext4 on the same disk); ext4 fast_commit: {}",
        kdir.display(),
        fc_how.as_deref().unwrap_or("not run")
    ));
    if let Some(info) = fc_info {
        r.notes.push(format!("ext4 fast_commit over the run (fc_info): {info}"));
    }
    if let Some(PerOp { writes, bytes, flushes }) = flush {
        r.notes.push(format!(
            "flush probe: an fdatasync with nothing to write shows on the disk as {writes:.2} writes of {bytes:.0} B \
             and {flushes:.2} flushes per call (the flush's empty request is counted as a write too), so a write \
             made durable by one flush shows as at least 2 device writes"
        ));
    }
    r.notes.push(match &disk {
        Some(p) => format!(
            "device writes, bytes and flushes: deltas of {} (fields 5, 7 and 16) over each measured phase, whoever \
             issued them: the pwfs image and the loop device's image are files on that disk, so the host's own \
             journal writes count too, and so does anything else writing to it meanwhile",
            p.display()
        ),
        None => "device rows left out: no /sys/dev/block stat file for the bench directory's device".into(),
    });
    if cols.contains(&Col::Ext4Fc) {
        let lo: Vec<String> = works
            .iter()
            .filter(|w| matches!(w, Work::Append(64) | Work::Append(4096) | Work::Overwrite(64) | Work::Varmail))
            .filter_map(|w| {
                let a = acc.get(&(w.row(), Col::Ext4Fc))?;
                let c = a.lo?;
                Some(format!(
                    "{} {:.2} writes, {:.2} flushes",
                    w.row(),
                    c.writes as f64 / a.ops as f64,
                    c.flushes.unwrap_or(0) as f64 / a.ops as f64
                ))
            })
            .collect();
        if !lo.is_empty() {
            r.notes.push(format!(
                "ext4 fast_commit, what ext4 itself sent to the loop device per op (the disk sees more: a flush of \
                 the loop device is an fsync of its image on the host's ext4): {}",
                lo.join("; ")
            ));
        }
    }
    for col in [Col::On, Col::ShimOn] {
        let hh: Vec<String> = works
            .iter()
            .filter_map(|w| {
                let a = acc.get(&(w.row(), col))?;
                let h = a.hh?;
                Some(format!(
                    "{}: {}/{} pages hitchhiked, {} data blocks logged whole, {} metadata deltas, {} of {} fsync \
                     commits commit block only, {:.0} B saved per op, {} retired",
                    w.row(),
                    h.hitchhiked,
                    h.sync_pages,
                    h.data_images,
                    h.meta_deltas,
                    h.commit_only,
                    h.sync_commits,
                    h.bytes_saved as f64 / a.ops as f64,
                    h.retired
                ))
            })
            .collect();
        if !hh.is_empty() {
            r.notes.push(format!("{}, HitchhikeStats over the measured ops: {}", col.name(), hh.join("; ")));
        }
    }
    if let Some(rig) = &shim {
        r.notes.push(format!(
            "shim on / shim off: {} (apps/append_sync.c, cc -O2: open O_CREAT|O_WRONLY|O_TRUNC, fsync and syncfs, \
             {WARM} untimed appends, then write(2) + fsync(2) per op, each timed with CLOCK_MONOTONIC; ops/s its \
             own, over its timed ops) under LD_PRELOAD={}, on a FUSE mount served by this process (as `pwfs mount` \
             mounts: noatime, the shim's socket served; the engine's Config as the API columns', hitchhike on \
             resp. off), a fresh mount per cell of the same image; the program waits for the bench before and \
             after its timed ops, where the device, HitchhikeStats and shim counters are read",
            rig.exe.file_name().unwrap_or_default().to_string_lossy(),
            rig.preload.display()
        ));
        let mut carried = Vec::new();
        let mut short = Vec::new();
        for w in &works {
            for col in [Col::ShimOn, Col::ShimOff] {
                let Some(a) = acc.get(&(w.row(), col)) else { continue };
                let requests = a.shim.unwrap_or(0);
                let per_op = requests as f64 / a.ops.max(1) as f64;
                carried.push(format!("{} {}: {per_op:.2}", w.row(), col.name()));
                // A write and an fsync per op, at least.
                if requests < 2 * a.ops {
                    short.push(format!("{} {}", w.row(), col.name()));
                }
            }
        }
        if !carried.is_empty() {
            r.notes.push(format!(
                "shim requests per op (answered by the mount's shim socket over the timed ops): {}",
                carried.join("; ")
            ));
        }
        if !short.is_empty() {
            r.notes.push(format!(
                "WARNING: the shim did not carry every write and fsync (fewer than 2 requests per op) in {}: \
                 those cells measured FUSE in part",
                short.join(", ")
            ));
        }
    }
    let undefined: Vec<String> = works
        .iter()
        .flat_map(|w| [Col::On, Col::ShimOn].map(|c| (w.row(), c)))
        .filter(|k| acc.get(k).and_then(|a| a.hh).is_some_and(|h| h.sync_pages == 0))
        .map(|(row, c)| format!("{row} ({})", c.name()))
        .collect();
    if !undefined.is_empty() {
        r.notes.push(format!(
            "no recognition figure for {}: no page of the synced file was written by a commit for an fsync (none \
             could hitchhike)",
            undefined.join(", ")
        ));
    }
    if wanted("append") {
        r.notes.push(
            "recognition: HitchhikeStats::hitchhiked / sync_pages over the measured ops (pages of fsync'd files \
             written by commits for an fsync that rode as deltas in the commit block); paper: Table 2 of the \
             Hitchhike paper (Filebench filemicro_writesync, appends with fsync)"
                .into(),
        );
    }
    r.notes.push(format!(
        "varmail: {VARMAIL_THREADS} threads, {VARMAIL_FILES} files each, appends of {}-{} B at random with fsync, one \
         op in {VARMAIL_DELETE_ONE_IN} deleting and creating its file first; {per_cell} ops per thread per cell",
        VARMAIL_SIZES.start(),
        VARMAIL_SIZES.end()
    ));
    Ok(r)
}

/// The shim columns: the compiled append_sync, the shim, where the mount goes and
/// where the program's latencies go.
struct ShimRig {
    exe: PathBuf,
    preload: PathBuf,
    mnt: PathBuf,
    scratch: PathBuf,
}

impl ShimRig {
    /// The shim columns can run: FUSE, the shim (seen loaded by a program) and `cc`,
    /// which builds append_sync into `scratch`; why not otherwise.
    fn make(dir: &Path) -> R<ShimRig> {
        use crate::apps::{locate, probe_preload, PRELOAD_ENV, PRELOAD_LIB};
        if !pwfs_fuse::can_mount() {
            return Err("a FUSE mount needs root and /dev/fuse".into());
        }
        let preload = locate(PRELOAD_ENV, PRELOAD_LIB, "cargo build --release -p pwfs-preload")
            .and_then(|l| probe_preload(&l))?;
        let scratch = dir.join("hitchhike-scratch");
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).map_err(err("scratch dir"))?;
        let exe = crate::programs::compile_c(&scratch, "append_sync.c", APPEND_SYNC_C, "append_sync", &[])?;
        Ok(ShimRig { exe, preload, mnt: dir.join("hitchhike-mnt"), scratch })
    }

    /// One cell: a fresh FUSE mount of `image` (the shim served, hitchhiking as
    /// `hitchhike` says), append_sync run on it under the shim for `n` timed appends of
    /// `size` bytes, its file removed and the mount closed.
    fn append(&self, image: &Path, hitchhike: bool, size: usize, n: usize, disk: &Option<PathBuf>) -> R<Cell> {
        let source = image.canonicalize().unwrap_or_else(|_| image.to_path_buf());
        // As `pwfs mount` mounts by default: the image as the source, noatime, the shim served.
        let options = pwfs_fuse::MountOptions {
            fsname: Some(source.to_string_lossy().into_owned()),
            flags: libc::MS_NOATIME,
            shim: true,
            ..Default::default()
        };
        let place = Place::fuse(image, pwfs_config(hitchhike), &self.mnt, &options)?;
        let file = place.dir.join("append.dat");
        let cell = self.run(&place, &file, size, n, disk);
        let removed = std::fs::remove_file(&file).map_err(err("unlink"));
        let closed = place.close();
        let cell = cell?;
        removed?;
        closed?;
        Ok(cell)
    }

    /// append_sync on `file`, its counters read when it is ready to time its appends
    /// and when it has printed its figures.
    fn run(&self, place: &Place, file: &Path, size: usize, n: usize, disk: &Option<PathBuf>) -> R<Cell> {
        let snap = || Snap {
            disk: disk.as_deref().and_then(Counts::read),
            lo: None,
            hh: place.fs().map(Fs::hitchhike_stats),
            shim: place.shim_counters().map(|c| c.requests),
        };
        let lat_file = self.scratch.join("append_sync.lat");
        let _ = std::fs::remove_file(&lat_file);
        let what = format!("append_sync {} {size} {n}", file.display());
        let mut child = crate::programs::command(&self.exe, Some(&self.preload))
            .env("APPEND_SYNC_HANDSHAKE", "1")
            .arg(file)
            .arg(size.to_string())
            .arg(n.to_string())
            .arg(&lat_file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(err(&what))?;
        let mut stdin = child.stdin.take();
        let mut out = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let timed = (|| -> R<(Snap, String, Snap)> {
            let mut line = String::new();
            out.read_line(&mut line).map_err(err("read its output"))?;
            if line.trim() != "ready" {
                return Err(format!("it printed {line:?} instead of \"ready\""));
            }
            let before = snap();
            stdin.as_mut().ok_or("no stdin")?.write_all(b"go\n").map_err(err("start it"))?;
            let mut result = String::new();
            out.read_line(&mut result).map_err(err("read its output"))?;
            let after = snap();
            Ok((before, result, after))
        })();
        // The end of its stdin lets it write its latencies and exit.
        drop(stdin);
        drop(out);
        let ended = child.wait_with_output().map_err(err(&what))?;
        if !ended.status.success() {
            return Err(format!("{what}: {}:\n{}", ended.status, crate::programs::tail(&ended.stderr, b"")));
        }
        let (before, result, after) = timed.map_err(|e| format!("{what}: {e}"))?;
        let figures: Vec<f64> = result.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        let &[rate, _p50, _p99] = &figures[..] else {
            return Err(format!("{what}: no \"ops_per_s p50_us p99_us\" line in {result:?}"));
        };
        let lat = std::fs::read_to_string(&lat_file)
            .map_err(err("its latencies"))?
            .lines()
            .map(|l| l.trim().parse::<f64>().map_err(|e| format!("its latencies: {l:?}: {e}")))
            .collect::<R<Vec<f64>>>()?;
        let _ = std::fs::remove_file(&lat_file);
        if lat.len() != n || !(rate.is_finite() && rate > 0.0) {
            return Err(format!("{what}: {} latencies for {n} appends, {rate} ops/s", lat.len()));
        }
        Ok(Cell::new(lat, n as f64 / rate, before, after))
    }
}

/// One cell: a fresh mount of the image (pwfs, through the API or under the shim) or
/// the kernel's directory.
#[allow(clippy::too_many_arguments)]
fn run_cell(
    col: Col,
    work: Work,
    n: usize,
    seed: u64,
    image: &Path,
    kdir: &Path,
    fc: Option<&LoopFs>,
    shim: Option<&ShimRig>,
    disk: &Option<PathBuf>,
    lo: &Option<PathBuf>,
) -> R<Cell> {
    let disk_now = || disk.as_deref().and_then(Counts::read);
    match col {
        Col::On | Col::Off => {
            let fs = pwfs::mount_image(image, pwfs_config(col == Col::On)).map_err(err("mount"))?;
            let snap = || Snap { disk: disk_now(), hh: Some(fs.hitchhike_stats()), ..Default::default() };
            let r = work.run(Fsys::Pwfs(&fs), n, seed, &snap);
            let synced = fs.sync().map_err(err("sync"));
            let unmounted = fs.unmount().map_err(err("unmount"));
            let cell = r?;
            synced?;
            unmounted?;
            Ok(cell)
        }
        Col::ShimOn | Col::ShimOff => {
            let Work::Append(size) = work else { return Err("the shim columns run the appends only".into()) };
            let rig = shim.ok_or("no shim")?;
            rig.append(image, col == Col::ShimOn, size, n, disk)
        }
        Col::Ext4 => {
            let snap = || Snap { disk: disk_now(), ..Default::default() };
            work.run(Fsys::Kernel(kdir), n, seed, &snap)
        }
        Col::Ext4Fc => {
            let fc = fc.ok_or("no ext4 fast_commit file system")?;
            let snap = || Snap { disk: disk_now(), lo: lo.as_deref().and_then(Counts::read), ..Default::default() };
            work.run(Fsys::Kernel(&fc.mnt), n, seed, &snap)
        }
    }
}

/// Grouped bars of ops/s by write size, one bar per column that ran the part (the
/// paper's aside), for the append workload and the overwrites; a panel for a part not
/// run is left out. A column keeps its colour in every panel.
pub fn plot(r: &Report) -> String {
    let colors = ["#d62728", "#1f77b4", "#9467bd", "#17becf", "#888888", "#ff7f0e", "#2ca02c"];
    let cols: Vec<&String> = r.columns.iter().filter(|c| *c != PAPER_COLUMN).collect();
    let panels: Vec<(&str, &str)> = [
        ("append", "append + fsync, ops/s by write size"),
        ("overwrite", "random overwrite + fdatasync (preallocated file), ops/s by write size"),
    ]
    .into_iter()
    .filter(|(p, _)| r.rows.iter().any(|x| x.name == format!("{p} 64 B")))
    .collect();
    let (pw, ph, pad) = (640.0, 220.0, 60.0);
    let height = panels.len() as f64 * (ph + pad + 20.0) + 70.0;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{height}' font-family='sans-serif' font-size='11'>\n",
        pw + 2.0 * pad
    );
    for (k, (part, title)) in panels.iter().enumerate() {
        let y0 = 30.0 + k as f64 * (ph + pad + 20.0);
        let max = SIZES
            .iter()
            .flat_map(|size| cols.iter().map(move |c| r.value(&format!("{part} {size} B"), c)))
            .filter(|v| v.is_finite())
            .fold(1.0f64, f64::max);
        s += &format!("<text x='{pad}' y='{}' font-size='13' font-weight='bold'>{title}</text>\n", y0 - 8.0);
        s += &format!("<rect x='{pad}' y='{y0}' width='{pw}' height='{ph}' fill='none' stroke='#ccc'/>\n");
        for tick in 0..=4 {
            let v = max * tick as f64 / 4.0;
            let y = y0 + ph - ph * tick as f64 / 4.0;
            s += &format!("<text x='{}' y='{}' text-anchor='end'>{v:.0}</text>\n", pad - 4.0, y + 4.0);
        }
        let group = pw / SIZES.len() as f64;
        // The columns with a figure in this panel, with their colour's index.
        let here: Vec<(usize, &String)> = cols
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, c)| SIZES.iter().any(|size| r.value(&format!("{part} {size} B"), c).is_finite()))
            .collect();
        for (j, size) in SIZES.iter().enumerate() {
            let name = format!("{part} {size} B");
            let bw = group * 0.8 / here.len().max(1) as f64;
            for (b, (c, col)) in here.iter().enumerate() {
                let v = r.value(&name, col);
                if !v.is_finite() {
                    continue;
                }
                let h = ph * v / max;
                let x = pad + j as f64 * group + group * 0.1 + b as f64 * bw;
                s += &format!(
                    "<rect x='{x:.1}' y='{:.1}' width='{:.1}' height='{h:.1}' fill='{}'><title>{col} {size} B: {v:.0} ops/s</title></rect>\n",
                    y0 + ph - h,
                    bw - 1.0,
                    colors[*c % colors.len()]
                );
            }
            let label = if *size >= 1024 { format!("{} KiB", size / 1024) } else { format!("{size} B") };
            s += &format!(
                "<text x='{:.1}' y='{}' text-anchor='middle'>{label}</text>\n",
                pad + j as f64 * group + group / 2.0,
                y0 + ph + 14.0
            );
        }
    }
    let step = ((pw + pad) / cols.len().max(1) as f64).min(130.0);
    for (c, name) in cols.iter().enumerate() {
        let x = pad + c as f64 * step;
        s += &format!(
            "<rect x='{x}' y='{}' width='10' height='10' fill='{}'/><text x='{}' y='{}'>{name}</text>\n",
            height - 30.0,
            colors[c % colors.len()],
            x + 14.0,
            height - 21.0
        );
    }
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke run fills every cell, states its targets, and draws the plot.
    #[test]
    fn smoke_run_fills_the_table() {
        let _one_at_a_time = crate::smoke_lock();
        let dir = std::env::temp_dir().join(format!("pwfs-bench-hitchhike-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        // Zero is a figure for flushes (a device without a volatile cache) and for
        // the recognition of writes no delta of fits (4 KiB of random bytes).
        let zero_ok = |name: &str| name.ends_with("device flushes") || name.ends_with("recognition");
        let mut filled = r.clone();
        filled.rows.retain(|row| !zero_ok(&row.name));
        filled.check_filled().unwrap();
        for row in r.rows.iter().filter(|row| zero_ok(&row.name)) {
            assert!(row.values.values().all(|v| v.is_finite() && *v >= 0.0), "{row:?}");
        }
        let pwfs_cols = [Col::On.name(), Col::Off.name(), Col::Ext4.name()];
        for size in SIZES {
            for part in ["append", "overwrite"] {
                let row = r.rows.iter().find(|x| x.name == format!("{part} {size} B")).unwrap();
                assert!(pwfs_cols.iter().all(|c| row.values.contains_key(*c)), "{row:?}");
            }
            assert!(r.rows.iter().any(|x| x.name == format!("append {size} B recognition")));
        }
        assert!(r.rows.iter().any(|x| x.name == "varmail p99"));
        // The shim columns, where they ran: every append row has them (check_filled: a
        // positive figure), no other row does, and the shim carried the calls.
        let shim_cols = [Col::ShimOn.name(), Col::ShimOff.name()];
        if r.columns.iter().any(|c| c == Col::ShimOn.name()) {
            for row in r.rows.iter().filter(|row| !row.name.ends_with("recognition")) {
                let has = shim_cols.map(|c| row.values.contains_key(c));
                let append = row.name.starts_with("append ");
                assert_eq!(has, [append, append], "{row:?}");
            }
            assert!(r.notes.iter().any(|n| n.starts_with("shim requests per op")), "{:?}", r.notes);
            assert!(!r.notes.iter().any(|n| n.contains("did not carry")), "{:?}", r.notes);
        } else {
            assert!(r.notes.iter().any(|n| n.starts_with("shim columns left out")), "{:?}", r.notes);
        }
        for (size, p) in PAPER {
            assert_eq!(r.value(&format!("append {size} B recognition"), PAPER_COLUMN), p);
        }
        assert!(r.targets.len() >= 2 + 1 + PAPER.len() + 2 * SIZES.len());
        let svg = plot(&r);
        assert!(svg.starts_with("<svg") && svg.contains("4 KiB") && svg.contains("hitchhike off"));
        assert!(r.json()["device"]["flush_us"].as_f64().is_some());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// `--only` runs the parts named; an unknown part is refused.
    #[test]
    fn only_refuses_an_unknown_part() {
        let dir = std::env::temp_dir().join(format!("pwfs-bench-hitchhike-only-{}", std::process::id()));
        let bad = Opts { only: vec!["appends".into()], ..Opts::smoke(dir.clone()) };
        assert!(run(&bad, &mut |_| {}).unwrap_err().contains("unknown part"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
