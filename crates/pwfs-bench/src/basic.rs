//! `pwfs bench basic`: the engine against the kernel on this disk, in one run.
//!
//! Columns: `pwfs` (the engine on an image file, io_uring, O_DIRECT, its own
//! cache), `ext4-buffered` and `ext4-direct` (a file of the same size on the host's
//! ext4, same disk), and `raw-uring` (io_uring O_DIRECT reads of the image itself:
//! the device floor). Cold means our cache is evicted and the kernel's pages of the
//! file are dropped (POSIX_FADV_DONTNEED) before the run; random reads touch distinct
//! pages, so no column can serve them from memory.

use crate::kernel::KFile;
use crate::{median, percentiles, shuffled_pages, Opts, Report};
use pwfs::device::uring::{UringDevice, UringOptions};
use pwfs::device::{AlignedBuf, Device, Op};
use pwfs::{Config, Fs, MkfsOptions, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

type R<T> = Result<T, String>;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// The cache Patchwork gets in this benchmark (the file is larger in full runs).
pub const CACHE_BYTES: u64 = 128 * MIB;

/// An image file written through once, so that the host has no unwritten extents
/// left in it (a read of one would not reach the device).
pub(crate) fn make_image(path: &Path, bytes: u64) -> R<()> {
    let mut f = std::fs::File::create(path).map_err(err("create image"))?;
    let chunk = vec![0u8; MIB as usize];
    for _ in 0..bytes / MIB {
        f.write_all(&chunk).map_err(err("fill image"))?;
    }
    f.sync_all().map_err(err("sync image"))?;
    drop(f);
    pwfs::mkfs_image(path, bytes, &MkfsOptions::default()).map_err(err("mkfs"))?;
    Ok(())
}

struct Sizes {
    pages: u64,
    chunk: usize,
}

impl Sizes {
    fn chunks(&self) -> u64 {
        self.pages * PAGE / self.chunk as u64
    }
    fn mbps(&self, t: Instant) -> f64 {
        (self.pages * PAGE) as f64 / MIB as f64 / t.elapsed().as_secs_f64()
    }
}

/// One column of the table: where the bytes go.
enum Target {
    Pwfs(Fs),
    Kernel { path: std::path::PathBuf, direct: bool },
    Raw { image: std::path::PathBuf, base: u64 },
}

pub(crate) fn open_raw(image: &Path) -> R<UringDevice> {
    UringDevice::open(image, &UringOptions { arena_bytes: 4 * MIB as usize, ..Default::default() })
        .map_err(err("open image"))
}

const PWFS_FILE: &str = "/seq";

impl Target {
    /// Write the whole file afresh in 1 MiB chunks and fsync it; MB/s.
    fn seq_write(&self, s: &Sizes) -> R<f64> {
        match self {
            Target::Pwfs(fs) => {
                let _ = fs.remove_file(PWFS_FILE);
                fs.sync().map_err(err("sync"))?;
                let data = vec![0x5au8; s.chunk];
                let t = Instant::now();
                let f = OpenOptions::new().write(true).create(true).truncate(true).open(fs, PWFS_FILE);
                let f = f.map_err(err("create"))?;
                for i in 0..s.chunks() {
                    f.write_all_at(&data, i * s.chunk as u64).map_err(err("write"))?;
                }
                f.sync_all().map_err(err("fsync"))?;
                Ok(s.mbps(t))
            }
            Target::Kernel { path, direct } => {
                let _ = std::fs::remove_file(path);
                let mut chunk = AlignedBuf::new(s.chunk);
                chunk.fill(0x5a);
                let t = Instant::now();
                let f = KFile::open(path, *direct, true).map_err(err("open"))?;
                for i in 0..s.chunks() {
                    f.pwrite(&chunk, i * s.chunk as u64).map_err(err("pwrite"))?;
                }
                f.fsync().map_err(err("fsync"))?;
                Ok(s.mbps(t))
            }
            Target::Raw { .. } => Ok(f64::NAN),
        }
    }

    /// Make the next reads cold.
    fn drop_cache(&self) -> R<()> {
        match self {
            Target::Pwfs(fs) => fs.evict_cache().map_err(err("evict")),
            Target::Kernel { path, direct } => {
                KFile::open(path, *direct, false).map_err(err("open"))?.drop_cache();
                Ok(())
            }
            Target::Raw { .. } => Ok(()),
        }
    }

    /// Read the whole file cold in 1 MiB chunks; MB/s.
    fn seq_read(&self, s: &Sizes) -> R<f64> {
        self.drop_cache()?;
        match self {
            Target::Pwfs(fs) => {
                let f = OpenOptions::new().read(true).open(fs, PWFS_FILE).map_err(err("open"))?;
                let mut buf = vec![0u8; s.chunk];
                let t = Instant::now();
                for i in 0..s.chunks() {
                    f.read_at(&mut buf, i * s.chunk as u64).map_err(err("read"))?;
                }
                Ok(s.mbps(t))
            }
            Target::Kernel { path, direct } => {
                let f = KFile::open(path, *direct, false).map_err(err("open"))?;
                let mut buf = AlignedBuf::new(s.chunk);
                let t = Instant::now();
                for i in 0..s.chunks() {
                    f.pread(&mut buf, i * s.chunk as u64).map_err(err("pread"))?;
                }
                Ok(s.mbps(t))
            }
            Target::Raw { image, base } => {
                let dev = open_raw(image)?;
                let mut buf = AlignedBuf::new(s.chunk);
                let t = Instant::now();
                for i in 0..s.chunks() {
                    let mut d = dev.submit(vec![Op::read(base + i * s.chunk as u64, buf)]);
                    let done = d.pop().expect("one op");
                    done.result.map_err(err("raw read"))?;
                    buf = done.bufs.into_iter().next().expect("buffer back");
                }
                Ok(s.mbps(t))
            }
        }
    }
}

/// An open handle for per-operation measurements.
enum Handle {
    Pwfs(pwfs::File),
    Kernel(KFile),
    Raw(UringDevice, u64),
}

impl Handle {
    fn open(t: &Target) -> R<Handle> {
        Ok(match t {
            Target::Pwfs(fs) => {
                Handle::Pwfs(OpenOptions::new().read(true).write(true).open(fs, PWFS_FILE).map_err(err("open"))?)
            }
            Target::Kernel { path, direct } => Handle::Kernel(KFile::open(path, *direct, false).map_err(err("open"))?),
            Target::Raw { image, base } => Handle::Raw(open_raw(image)?, *base),
        })
    }

    /// Latency of one 4 KiB read of page `p`, in microseconds.
    fn read(&self, p: u64, buf: &mut AlignedBuf) -> R<f64> {
        let t = Instant::now();
        match self {
            Handle::Pwfs(f) => {
                f.read_at(buf, p * PAGE).map_err(err("read"))?;
            }
            Handle::Kernel(f) => f.pread(buf, p * PAGE).map_err(err("pread"))?,
            Handle::Raw(dev, base) => {
                let (_, r) = dev.read(base + p * PAGE, dev.alloc(PAGE as usize));
                r.map_err(err("raw read"))?;
            }
        }
        Ok(us(t))
    }

    /// Latency of a 4 KiB overwrite of page `p` followed by fdatasync.
    fn write_sync(&self, p: u64, page: &AlignedBuf) -> R<f64> {
        let t = Instant::now();
        match self {
            Handle::Pwfs(f) => {
                f.write_all_at(page, p * PAGE).map_err(err("write"))?;
                f.sync_data().map_err(err("fdatasync"))?;
            }
            Handle::Kernel(f) => {
                f.pwrite(page, p * PAGE).map_err(err("pwrite"))?;
                f.file.sync_data().map_err(err("fdatasync"))?;
            }
            Handle::Raw(..) => return Ok(f64::NAN),
        }
        Ok(us(t))
    }
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    let _ = std::fs::create_dir_all(&o.dir);
    let device = crate::DeviceProbe::measure(&o.dir);
    std::fs::create_dir_all(&o.dir).map_err(err("create bench dir"))?;
    let s = Sizes { pages: o.file_mib * MIB / PAGE, chunk: MIB as usize };
    let image = o.dir.join("basic.img");
    progress("preparing the image");
    make_image(&image, (2 * o.file_mib + 64) * MIB)?;
    let config = Config { cache_bytes: CACHE_BYTES, ..Default::default() };
    let fs = pwfs::mount_image(&image, config).map_err(err("mount"))?;
    let base = fs.superblock().data_start * PAGE;
    let kb_path = o.dir.join("kernel-buffered.dat");
    let kd_path = o.dir.join("kernel-direct.dat");
    let targets = [
        Target::Pwfs(fs.clone()),
        Target::Kernel { path: kb_path.clone(), direct: false },
        Target::Kernel { path: kd_path.clone(), direct: true },
        Target::Raw { image: image.clone(), base },
    ];
    // Every measurement alternates between the columns, so that drift of the shared
    // machine (which is large) falls on all of them alike.
    let mut seqw: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let mut seqr: Vec<Vec<f64>> = vec![Vec::new(); 4];
    for run in 0..o.runs {
        progress(&format!("sequential write and read, run {} of {}", run + 1, o.runs));
        for (i, t) in targets.iter().enumerate() {
            seqw[i].push(t.seq_write(&s)?);
        }
        for (i, t) in targets.iter().enumerate() {
            seqr[i].push(t.seq_read(&s)?);
        }
    }
    progress("random 4 KiB reads and write+fsync");
    let handles: Vec<Handle> = targets.iter().map(Handle::open).collect::<R<_>>()?;
    for t in &targets {
        t.drop_cache()?;
    }
    let mut buf = AlignedBuf::new(PAGE as usize);
    let mut cold: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let orders: Vec<Vec<u64>> = (0..4).map(|i| shuffled_pages(s.pages, o.ops, o.seed + i)).collect();
    let mut orders: Vec<std::vec::IntoIter<u64>> = orders.into_iter().map(Vec::into_iter).collect();
    'cold: loop {
        for (i, h) in handles.iter().enumerate() {
            let Some(p) = orders[i].next() else { break 'cold };
            cold[i].push(h.read(p, &mut buf)?);
        }
    }
    let warm_set = shuffled_pages(s.pages, o.ops.min(1000), o.seed + 10);
    let mut warm: Vec<Vec<f64>> = vec![Vec::new(); 2];
    for h in &handles[..2] {
        for p in &warm_set {
            h.read(*p, &mut buf)?;
        }
    }
    for p in &warm_set {
        for (i, h) in handles[..2].iter().enumerate() {
            warm[i].push(h.read(*p, &mut buf)?);
        }
    }
    let mut page = AlignedBuf::new(PAGE as usize);
    page.fill(0xa5);
    let mut wsync: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for p in shuffled_pages(s.pages, o.ops.min(1000), o.seed + 20) {
        for (i, h) in handles[..3].iter().enumerate() {
            wsync[i].push(h.write_sync(p, &page)?);
        }
    }
    drop(handles);
    let js = fs.journal_stats();
    drop(targets);
    fs.unmount().map_err(err("unmount"))?;
    for f in [&image, &kb_path, &kd_path] {
        let _ = std::fs::remove_file(f);
    }

    let mut r = Report {
        title: format!(
            "pwfs bench basic: {} MiB file, {} random ops, median of {} runs (pwfs cache {} MiB), columns interleaved",
            o.file_mib,
            o.ops,
            o.runs,
            CACHE_BYTES / MIB
        ),
        columns: ["pwfs", "ext4-buffered", "ext4-direct", "raw-uring"].map(String::from).to_vec(),
        device: Some(device),
        ..Default::default()
    };
    let names = ["pwfs", "ext4-buffered", "ext4-direct", "raw-uring"];
    let p = |v: &[Vec<f64>], q: usize| -> Vec<(&str, f64)> {
        v.iter()
            .zip(names)
            .map(|(x, n)| {
                let (p50, p99) = percentiles(x.clone());
                (n, if q == 50 { p50 } else { p99 })
            })
            .collect()
    };
    let med = |v: &[Vec<f64>], cols: usize| -> Vec<(&str, f64)> {
        v.iter().take(cols).zip(names).map(|(x, n)| (n, median(x.clone()))).collect()
    };
    r.row("cold 4K randread p50", "us", true, &p(&cold, 50));
    r.row("cold 4K randread p99", "us", true, &p(&cold, 99));
    r.row("4K write+fdatasync p50", "us", true, &p(&wsync, 50));
    r.row("4K write+fdatasync p99", "us", true, &p(&wsync, 99));
    r.row("seq write 1M + fsync", "MB/s", false, &med(&seqw, 3));
    r.row("seq read 1M cold", "MB/s", false, &med(&seqr, 4));
    r.row("warm 4K read p50", "us", true, &p(&warm, 50));
    r.target("cold 4K read latency vs the device", "cold 4K randread p50", "pwfs", "raw-uring", Some(1.5), None);
    r.target("sequential write vs kernel O_DIRECT", "seq write 1M + fsync", "pwfs", "ext4-direct", None, Some(0.8));
    r.target("sequential read vs kernel O_DIRECT", "seq read 1M cold", "pwfs", "ext4-direct", None, Some(0.8));
    r.notes.push(format!(
        "pwfs journal over the run: {} commits, {} blocks logged, {} checkpoints",
        js.commits, js.blocks_logged, js.checkpoints
    ));
    r.notes.push("kernel columns use a file on the host's ext4 on the same disk; the buffered column may use all of RAM for its cache, so its warm and write numbers are not memory-bounded like pwfs's".into());
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke run completes and fills every cell it should; benchmarks cannot rot.
    #[test]
    fn smoke_run_fills_the_table() {
        let _one_at_a_time = crate::smoke_lock();
        let dir = std::env::temp_dir().join(format!("pwfs-bench-smoke-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        r.check_filled().unwrap();
        assert_eq!(r.targets.len(), 3);
        let j = r.json();
        assert_eq!(j["rows"].as_array().unwrap().len(), r.rows.len());
        assert!(r.table().contains("cold 4K randread p50"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
