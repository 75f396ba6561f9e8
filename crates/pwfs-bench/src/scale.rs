//! `pwfs bench scale`: how the engine's throughput grows with threads, against ext4
//! on the same disk, in one run.
//!
//! Rows (ops/s, all threads together), for 1, 2, 4 and 8 threads:
//! - (a) 4 KiB overwrites of private files (cached, no fsync);
//! - (b) 4 KiB reads of one shared file, all cached;
//! - (c) create + stat + unlink in private directories;
//! - (d) 2 KiB writes into cached pages of private files.
//!
//! The bytes (a) and (d) touch are the same at every thread count (`PRIVATE_BYTES`,
//! split evenly: one thread writes all 4 MiB of its file, eight threads the first
//! 512 KiB of theirs; every file is 4 MiB, written whole, on both sides). The rows
//! compare locks, not cache sizes: with 4 MiB per thread, eight threads touch 32 MiB
//! and two 8 MiB, and on this machine (4 MiB of L2 per core) that alone costs eight
//! threads 7-14% against two with no lock taken at all (docs/BENCHMARKS.md, "What 8
//! threads measure"), while a system call per write (ext4) hides it.
//!
//! Patchwork runs through its Rust API (no system call), ext4 through pread/pwrite
//! and the usual path calls. Every cell is measured `runs` times in rotating order
//! (columns interleaved, so drift on this shared machine spreads over all of them)
//! and the median is reported.

use crate::report::DeviceProbe;
use crate::{median, Opts, Report};
use pwfs::{Config, Fs, MkfsOptions, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;
/// The private files of (a) and (d) (each), and the bytes all threads of a cell touch
/// together.
const PRIVATE_BYTES: u64 = 4 * MIB;
/// The shared file of (b).
const SHARED_BYTES: u64 = 16 * MIB;
pub const THREADS: [usize; 4] = [1, 2, 4, 8];

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The four workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    Overwrite,
    SharedRead,
    CreateStatUnlink,
    SmallWrite,
}

impl Load {
    pub const ALL: [Load; 4] = [Load::Overwrite, Load::SharedRead, Load::CreateStatUnlink, Load::SmallWrite];

    /// The name `--only` takes.
    pub fn part(self) -> &'static str {
        match self {
            Load::Overwrite => "overwrite",
            Load::SharedRead => "read",
            Load::CreateStatUnlink => "create",
            Load::SmallWrite => "smallwrite",
        }
    }

    pub fn row(self) -> &'static str {
        match self {
            Load::Overwrite => "(a) 4K overwrite, private files",
            Load::SharedRead => "(b) 4K cached read, shared file",
            Load::CreateStatUnlink => "(c) create+stat+unlink",
            Load::SmallWrite => "(d) 2K write into cached pages",
        }
    }
}

/// Where a cell runs.
enum Side<'a> {
    Pwfs(&'a Fs),
    Ext4(&'a Path),
}

impl Side<'_> {
    fn name(&self) -> &'static str {
        match self {
            Side::Pwfs(_) => "pwfs",
            Side::Ext4(_) => "ext4",
        }
    }
}

/// A thread's handle for one cell.
enum Handle {
    /// The file system, the file of the cell, the path of the thread's file or directory.
    Pwfs(Fs, Option<pwfs::File>, String),
    Ext4(PathBuf, Option<std::fs::File>),
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn private_name(load: Load, t: usize) -> String {
    match load {
        Load::Overwrite => format!("a{t}"),
        Load::SmallWrite => format!("d{t}"),
        Load::SharedRead => "shared".into(),
        Load::CreateStatUnlink => format!("c{t}"),
    }
}

impl Handle {
    fn open(side: &Side, load: Load, t: usize) -> R<Handle> {
        let name = private_name(load, t);
        Ok(match side {
            Side::Pwfs(fs) => {
                let f = match load {
                    Load::CreateStatUnlink => None,
                    _ => Some(
                        OpenOptions::new().read(true).write(true).open(fs, format!("/{name}")).map_err(err("open"))?,
                    ),
                };
                Handle::Pwfs((*fs).clone(), f, format!("/{name}"))
            }
            Side::Ext4(dir) => {
                let f = match load {
                    Load::CreateStatUnlink => None,
                    _ => Some(
                        std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .open(dir.join(&name))
                            .map_err(err("open"))?,
                    ),
                };
                Handle::Ext4(dir.join(name), f)
            }
        })
    }

    /// One operation; `i` counts this thread's operations, `rng` its offsets, `span`
    /// is the part of a private file the thread writes.
    fn op(&self, load: Load, i: u64, rng: &mut u64, buf: &mut [u8], span: u64) -> R<()> {
        match load {
            Load::Overwrite => self.write(&buf[..PAGE as usize], (xorshift(rng) % (span / PAGE)) * PAGE),
            Load::SmallWrite => self.write(&buf[..2048], (xorshift(rng) % (span / 2048)) * 2048),
            Load::SharedRead => self.read(&mut buf[..PAGE as usize], (xorshift(rng) % (SHARED_BYTES / PAGE)) * PAGE),
            Load::CreateStatUnlink => match self {
                Handle::Pwfs(fs, _, dir) => {
                    let p = format!("{dir}/f{i}");
                    drop(fs.create(&p).map_err(err("create"))?);
                    fs.metadata(&p).map_err(err("stat"))?;
                    fs.remove_file(&p).map_err(err("unlink"))
                }
                Handle::Ext4(dir, _) => {
                    let p = dir.join(format!("f{i}"));
                    drop(std::fs::File::create(&p).map_err(err("create"))?);
                    std::fs::metadata(&p).map_err(err("stat"))?;
                    std::fs::remove_file(&p).map_err(err("unlink"))
                }
            },
        }
    }

    fn write(&self, data: &[u8], off: u64) -> R<()> {
        match self {
            Handle::Pwfs(_, Some(f), _) => f.write_all_at(data, off).map_err(err("write")),
            Handle::Ext4(_, Some(f)) => f.write_all_at(data, off).map_err(err("pwrite")),
            _ => Err("no file".into()),
        }
    }

    fn read(&self, buf: &mut [u8], off: u64) -> R<()> {
        match self {
            Handle::Pwfs(_, Some(f), _) => {
                let n = f.read_at(buf, off).map_err(err("read"))?;
                if n != buf.len() {
                    return Err(format!("short read: {n}"));
                }
                Ok(())
            }
            Handle::Ext4(_, Some(f)) => f.read_exact_at(buf, off).map_err(err("pread")),
            _ => Err("no file".into()),
        }
    }
}

/// The bytes of its private file each of `threads` threads writes: `PRIVATE_BYTES`
/// shared out, whole pages, at least one.
fn private_span(threads: usize) -> u64 {
    (PRIVATE_BYTES / threads.max(1) as u64 / PAGE).max(1) * PAGE
}

/// Run `threads` threads of `load` on `side` for `dur`; ops/s of all of them.
fn cell(side: &Side, load: Load, threads: usize, dur: Duration) -> R<f64> {
    let handles: Vec<Handle> = (0..threads).map(|t| Handle::open(side, load, t)).collect::<R<_>>()?;
    let span = private_span(threads);
    let barrier = Barrier::new(threads + 1);
    let stop = AtomicBool::new(false);
    let total = AtomicU64::new(0);
    let failed: std::sync::Mutex<Option<String>> = Default::default();
    let elapsed = std::thread::scope(|s| {
        for (t, h) in handles.iter().enumerate() {
            let (barrier, stop, total, failed) = (&barrier, &stop, &total, &failed);
            s.spawn(move || {
                let mut buf = vec![0x5au8 + t as u8; PAGE as usize];
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
                let mut i = 0u64;
                barrier.wait();
                while !stop.load(Ordering::Relaxed) {
                    if let Err(e) = h.op(load, i, &mut rng, &mut buf, span) {
                        *failed.lock().unwrap() = Some(e);
                        break;
                    }
                    i += 1;
                }
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        barrier.wait();
        let t = Instant::now();
        std::thread::sleep(dur);
        stop.store(true, Ordering::Relaxed);
        t
    });
    // Threads finish the operation they are in; count the time until they all have.
    let secs = elapsed.elapsed().as_secs_f64();
    if let Some(e) = failed.into_inner().unwrap() {
        return Err(format!("{} {:?} x{threads}: {e}", side.name(), load));
    }
    Ok(total.load(Ordering::Relaxed) as f64 / secs)
}

/// Files and directories every cell expects, on both sides; the shared file and the
/// private files are written whole, so that they are cached and allocated.
fn prepare(fs: &Fs, dir: &Path) -> R<()> {
    let fill = |bytes: u64| vec![0x11u8; bytes as usize];
    for t in 0..THREADS[THREADS.len() - 1] {
        for load in [Load::Overwrite, Load::SmallWrite] {
            let name = private_name(load, t);
            fs.write_file(format!("/{name}"), &fill(PRIVATE_BYTES)).map_err(err("pwfs prepare"))?;
            std::fs::write(dir.join(&name), fill(PRIVATE_BYTES)).map_err(err("ext4 prepare"))?;
        }
        let name = private_name(Load::CreateStatUnlink, t);
        fs.create_dir(format!("/{name}"), 0o755).map_err(err("pwfs mkdir"))?;
        std::fs::create_dir_all(dir.join(&name)).map_err(err("ext4 mkdir"))?;
    }
    fs.write_file("/shared", &fill(SHARED_BYTES)).map_err(err("pwfs prepare"))?;
    std::fs::write(dir.join("shared"), fill(SHARED_BYTES)).map_err(err("ext4 prepare"))?;
    fs.sync().map_err(err("sync"))?;
    // The kernel's files start on disk too, as the engine's do.
    // SAFETY: sync(2) has no arguments and cannot fail.
    unsafe { libc::sync() };
    // Warm both caches with the shared file.
    let mut buf = vec![0u8; MIB as usize];
    let f = OpenOptions::new().read(true).open(fs, "/shared").map_err(err("open"))?;
    let k = std::fs::File::open(dir.join("shared")).map_err(err("open"))?;
    for i in 0..SHARED_BYTES / MIB {
        f.read_at(&mut buf, i * MIB).map_err(err("read"))?;
        k.read_exact_at(&mut buf, i * MIB).map_err(err("pread"))?;
    }
    Ok(())
}

pub fn column(side: &str, threads: usize) -> String {
    format!("{side}-{threads}")
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    for part in &o.only {
        if !Load::ALL.iter().any(|l| l.part() == part) {
            let known: Vec<&str> = Load::ALL.iter().map(|l| l.part()).collect();
            return Err(format!("unknown part {part:?} of bench scale (known: {})", known.join(", ")));
        }
    }
    let loads: Vec<Load> =
        Load::ALL.into_iter().filter(|l| o.only.is_empty() || o.only.iter().any(|p| p == l.part())).collect();
    std::fs::create_dir_all(&o.dir).map_err(err("bench dir"))?;
    let device = DeviceProbe::measure(&o.dir);
    let (dur, rounds) = match o.ops {
        n if n <= 100 => (Duration::from_millis(40), 1),
        n if n <= 2000 => (Duration::from_millis(300), 3),
        _ => (Duration::from_millis(700), 5),
    };
    let image = o.dir.join("scale.img");
    let kdir = o.dir.join("scale-ext4");
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_dir_all(&kdir);
    std::fs::create_dir_all(&kdir).map_err(err("ext4 dir"))?;
    pwfs::mkfs_image(&image, 1024 * MIB, &MkfsOptions::default()).map_err(err("mkfs"))?;
    let fs =
        pwfs::mount_image(&image, Config { cache_bytes: 256 * MIB, ..Default::default() }).map_err(err("mount"))?;
    progress("preparing files");
    prepare(&fs, &kdir)?;
    let mut cells: Vec<(Load, usize, usize)> = Vec::new(); // (load, side 0 pwfs / 1 ext4, threads)
    for &load in &loads {
        for side in 0..2 {
            for t in THREADS {
                cells.push((load, side, t));
            }
        }
    }
    let mut samples: std::collections::HashMap<(usize, usize, usize), Vec<f64>> = Default::default();
    for round in 0..rounds {
        progress(&format!("round {} of {rounds}", round + 1));
        // Rotate the order inside each workload, so that no column always runs first.
        for (li, load) in Load::ALL.into_iter().enumerate().filter(|(_, l)| loads.contains(l)) {
            let mut mine: Vec<&(Load, usize, usize)> = cells.iter().filter(|c| c.0 == load).collect();
            let k = mine.len();
            mine.rotate_left((round * 3 + li) % k);
            for &&(load, side, t) in &mine {
                let s = if side == 0 { Side::Pwfs(&fs) } else { Side::Ext4(&kdir) };
                let v = cell(&s, load, t, dur)?;
                samples.entry((li, side, t)).or_default().push(v);
            }
        }
    }
    let js = fs.journal_stats();
    fs.unmount().map_err(err("unmount"))?;
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_dir_all(&kdir);

    let mut columns = Vec::new();
    for side in ["pwfs", "ext4"] {
        for t in THREADS {
            columns.push(column(side, t));
        }
    }
    let mut r = Report {
        title: format!(
            "pwfs bench scale: ops/s of 1-8 threads, median of {rounds} rounds of {} ms, cells interleaved",
            dur.as_millis()
        ),
        columns: columns.clone(),
        ratio_bases: vec![column("pwfs", 1), column("ext4", 1)],
        device: Some(device),
        ..Default::default()
    };
    for (li, load) in Load::ALL.into_iter().enumerate().filter(|(_, l)| loads.contains(l)) {
        let mut values: Vec<(String, f64)> = Vec::new();
        for (side, name) in ["pwfs", "ext4"].iter().enumerate() {
            for t in THREADS {
                values.push((column(name, t), median(samples[&(li, side, t)].clone())));
            }
        }
        let values: Vec<(&str, f64)> = values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        r.row(load.row(), "ops/s", false, &values);
    }
    let (p1, p2, p8) = (column("pwfs", 1), column("pwfs", 2), column("pwfs", 8));
    for (load, at_least) in [(Load::Overwrite, 1.6), (Load::SharedRead, 1.6), (Load::CreateStatUnlink, 1.3)] {
        if loads.contains(&load) {
            r.target("2 threads vs 1", load.row(), &p2, &p1, None, Some(at_least));
        }
    }
    for &load in &loads {
        r.target("8 threads not slower than 2", load.row(), &p8, &p2, None, Some(0.95));
    }
    if loads.contains(&Load::SmallWrite) {
        r.target(
            "one thread vs ext4 buffered pwrite",
            Load::SmallWrite.row(),
            &p1,
            &column("ext4", 1),
            None,
            Some(3.0),
        );
    }
    r.notes.push(format!(
        "pwfs journal over the run: {} commits, {} blocks logged, {} checkpoints",
        js.commits, js.blocks_logged, js.checkpoints
    ));
    r.notes.push("8 threads on 2 cores: 'not slower' allows 5% for scheduling noise".into());
    r.notes.push(format!(
        "(a) and (d): the threads of a cell write {} KiB together, each its share of a private 4 MiB file \
         (1 thread: 4 MiB; 8 threads: 512 KiB each)",
        PRIVATE_BYTES / 1024
    ));
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke run fills every cell, states every target, and records the device.
    #[test]
    fn smoke_run_fills_the_table() {
        let _one_at_a_time = crate::smoke_lock();
        let dir = std::env::temp_dir().join(format!("pwfs-bench-scale-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        r.check_filled().unwrap();
        assert_eq!(r.rows.len(), 4);
        assert_eq!(r.columns.len(), 8);
        assert_eq!(r.targets.len(), 8);
        let j = r.json();
        assert!(j["device"]["read_4k_us"].as_f64().is_some_and(|v| v > 0.0), "{j}");
        assert!(j["device"]["flush_us"].as_f64().is_some_and(|v| v > 0.0), "{j}");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The threads of a cell share out the same bytes, in whole pages.
    #[test]
    fn private_spans_share_out_the_working_set() {
        assert_eq!(private_span(1), PRIVATE_BYTES);
        assert_eq!(private_span(2) * 2, PRIVATE_BYTES);
        assert_eq!(private_span(8) * 8, PRIVATE_BYTES);
        assert_eq!(private_span(3) % PAGE, 0);
        assert!(private_span(3) * 3 <= PRIVATE_BYTES);
        assert_eq!(private_span(1 << 20), PAGE);
    }
}
