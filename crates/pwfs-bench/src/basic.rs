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
fn make_image(path: &Path, bytes: u64) -> R<()> {
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

fn pwfs_side(fs: &Fs, o: &Opts, s: &Sizes) -> R<Vec<(&'static str, f64)>> {
    let data = vec![0x5au8; s.chunk];
    let mut wr = Vec::new();
    let mut rd = Vec::new();
    for _ in 0..o.runs {
        let _ = fs.remove_file("/seq");
        fs.sync().map_err(err("sync"))?;
        let t = Instant::now();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(fs, "/seq")
            .map_err(err("create"))?;
        for i in 0..s.pages * PAGE / s.chunk as u64 {
            f.write_at(&data, i * s.chunk as u64).map_err(err("write"))?;
        }
        f.sync_all().map_err(err("fsync"))?;
        wr.push((s.pages * PAGE) as f64 / MIB as f64 / t.elapsed().as_secs_f64());
        fs.evict_cache().map_err(err("evict"))?;
        let mut buf = vec![0u8; s.chunk];
        let t = Instant::now();
        for i in 0..s.pages * PAGE / s.chunk as u64 {
            f.read_at(&mut buf, i * s.chunk as u64).map_err(err("read"))?;
        }
        rd.push((s.pages * PAGE) as f64 / MIB as f64 / t.elapsed().as_secs_f64());
    }
    let f = OpenOptions::new().read(true).write(true).open(fs, "/seq").map_err(err("open"))?;
    fs.evict_cache().map_err(err("evict"))?;
    let mut buf = vec![0u8; PAGE as usize];
    let mut cold = Vec::new();
    for p in shuffled_pages(s.pages, o.ops, o.seed) {
        let t = Instant::now();
        f.read_at(&mut buf, p * PAGE).map_err(err("read"))?;
        cold.push(us(t));
    }
    let warm_set = shuffled_pages(s.pages, o.ops.min(1000), o.seed + 1);
    for p in &warm_set {
        f.read_at(&mut buf, p * PAGE).map_err(err("read"))?;
    }
    let mut warm = Vec::new();
    for p in &warm_set {
        let t = Instant::now();
        f.read_at(&mut buf, p * PAGE).map_err(err("read"))?;
        warm.push(us(t));
    }
    let page = vec![0xa5u8; PAGE as usize];
    let mut wf = Vec::new();
    for p in shuffled_pages(s.pages, o.ops.min(1000), o.seed + 2) {
        let t = Instant::now();
        f.write_at(&page, p * PAGE).map_err(err("write"))?;
        f.sync_data().map_err(err("fsync"))?;
        wf.push(us(t));
    }
    let (c50, c99) = percentiles(cold);
    let (w50, w99) = percentiles(wf);
    Ok(vec![
        ("cold50", c50),
        ("cold99", c99),
        ("warm50", percentiles(warm).0),
        ("wf50", w50),
        ("wf99", w99),
        ("seqw", median(wr)),
        ("seqr", median(rd)),
    ])
}

fn kernel_side(path: &Path, direct: bool, o: &Opts, s: &Sizes) -> R<Vec<(&'static str, f64)>> {
    let mut chunk = AlignedBuf::new(s.chunk);
    chunk.fill(0x5a);
    let mut wr = Vec::new();
    let mut rd = Vec::new();
    for _ in 0..o.runs {
        let _ = std::fs::remove_file(path);
        let f = KFile::open(path, direct, true).map_err(err("open"))?;
        let t = Instant::now();
        for i in 0..s.pages * PAGE / s.chunk as u64 {
            f.pwrite(&chunk, i * s.chunk as u64).map_err(err("pwrite"))?;
        }
        f.fsync().map_err(err("fsync"))?;
        wr.push((s.pages * PAGE) as f64 / MIB as f64 / t.elapsed().as_secs_f64());
        f.drop_cache();
        let t = Instant::now();
        for i in 0..s.pages * PAGE / s.chunk as u64 {
            f.pread(&mut chunk, i * s.chunk as u64).map_err(err("pread"))?;
        }
        rd.push((s.pages * PAGE) as f64 / MIB as f64 / t.elapsed().as_secs_f64());
    }
    let f = KFile::open(path, direct, false).map_err(err("open"))?;
    f.drop_cache();
    let mut buf = AlignedBuf::new(PAGE as usize);
    let mut cold = Vec::new();
    for p in shuffled_pages(s.pages, o.ops, o.seed) {
        let t = Instant::now();
        f.pread(&mut buf, p * PAGE).map_err(err("pread"))?;
        cold.push(us(t));
    }
    let mut warm = Vec::new();
    if !direct {
        let warm_set = shuffled_pages(s.pages, o.ops.min(1000), o.seed + 1);
        for p in &warm_set {
            f.pread(&mut buf, p * PAGE).map_err(err("pread"))?;
        }
        for p in &warm_set {
            let t = Instant::now();
            f.pread(&mut buf, p * PAGE).map_err(err("pread"))?;
            warm.push(us(t));
        }
    }
    let mut page = AlignedBuf::new(PAGE as usize);
    page.fill(0xa5);
    let mut wf = Vec::new();
    for p in shuffled_pages(s.pages, o.ops.min(1000), o.seed + 2) {
        let t = Instant::now();
        f.pwrite(&page, p * PAGE).map_err(err("pwrite"))?;
        f.file.sync_data().map_err(err("fdatasync"))?;
        wf.push(us(t));
    }
    let (c50, c99) = percentiles(cold);
    let (w50, w99) = percentiles(wf);
    Ok(vec![
        ("cold50", c50),
        ("cold99", c99),
        ("warm50", percentiles(warm).0),
        ("wf50", w50),
        ("wf99", w99),
        ("seqw", median(wr)),
        ("seqr", median(rd)),
    ])
}

/// io_uring O_DIRECT straight on the image: the floor for reads.
fn raw_side(image: &Path, data_start: u64, o: &Opts, s: &Sizes) -> R<Vec<(&'static str, f64)>> {
    let dev = UringDevice::open(image, &UringOptions { arena_bytes: 4 * MIB as usize, ..Default::default() })
        .map_err(err("open image"))?;
    let base = data_start * PAGE;
    let mut cold = Vec::new();
    for p in shuffled_pages(s.pages, o.ops, o.seed + 3) {
        let t = Instant::now();
        let (_, r) = dev.read(base + p * PAGE, dev.alloc(PAGE as usize));
        r.map_err(err("raw read"))?;
        cold.push(us(t));
    }
    let mut rd = Vec::new();
    let mut buf = AlignedBuf::new(s.chunk);
    for _ in 0..o.runs {
        let t = Instant::now();
        for i in 0..s.pages * PAGE / s.chunk as u64 {
            let mut d = dev.submit(vec![Op::read(base + i * s.chunk as u64, buf)]);
            let done = d.pop().expect("one op");
            done.result.map_err(err("raw read"))?;
            buf = done.bufs.into_iter().next().expect("buffer back");
        }
        rd.push((s.pages * PAGE) as f64 / MIB as f64 / t.elapsed().as_secs_f64());
    }
    let (c50, c99) = percentiles(cold);
    Ok(vec![("cold50", c50), ("cold99", c99), ("seqr", median(rd))])
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    std::fs::create_dir_all(&o.dir).map_err(err("create bench dir"))?;
    let s = Sizes { pages: o.file_mib * MIB / PAGE, chunk: MIB as usize };
    let image = o.dir.join("basic.img");
    progress("preparing the image");
    make_image(&image, (2 * o.file_mib + 64) * MIB)?;
    let config = Config { cache_bytes: CACHE_BYTES, ..Default::default() };
    let fs = pwfs::mount_image(&image, config).map_err(err("mount"))?;
    let data_start = fs.superblock().data_start;
    progress("pwfs");
    let p = pwfs_side(&fs, o, &s)?;
    let js = fs.journal_stats();
    fs.unmount().map_err(err("unmount"))?;
    progress("ext4 buffered");
    let kb_path = o.dir.join("kernel-buffered.dat");
    let kb = kernel_side(&kb_path, false, o, &s)?;
    progress("ext4 O_DIRECT");
    let kd_path = o.dir.join("kernel-direct.dat");
    let kd = kernel_side(&kd_path, true, o, &s)?;
    progress("raw io_uring");
    let raw = raw_side(&image, data_start, o, &s)?;
    for f in [&image, &kb_path, &kd_path] {
        let _ = std::fs::remove_file(f);
    }

    let get = |v: &[(&str, f64)], k: &str| v.iter().find(|x| x.0 == k).map(|x| x.1).unwrap_or(f64::NAN);
    let mut r = Report {
        title: format!(
            "pwfs bench basic: {} MiB file, {} random ops, median of {} runs (pwfs cache {} MiB)",
            o.file_mib,
            o.ops,
            o.runs,
            CACHE_BYTES / MIB
        ),
        columns: ["pwfs", "ext4-buffered", "ext4-direct", "raw-uring"].map(String::from).to_vec(),
        ..Default::default()
    };
    let cols = |k: &str, with_raw: bool| {
        let mut v = vec![("pwfs", get(&p, k)), ("ext4-buffered", get(&kb, k)), ("ext4-direct", get(&kd, k))];
        if with_raw {
            v.push(("raw-uring", get(&raw, k)));
        }
        v
    };
    r.row("cold 4K randread p50", "us", true, &cols("cold50", true));
    r.row("cold 4K randread p99", "us", true, &cols("cold99", true));
    r.row("4K write+fsync p50", "us", true, &cols("wf50", false));
    r.row("4K write+fsync p99", "us", true, &cols("wf99", false));
    r.row("seq write 1M + fsync", "MB/s", false, &cols("seqw", false));
    r.row("seq read 1M cold", "MB/s", false, &cols("seqr", true));
    r.row("warm 4K read p50", "us", true, &[("pwfs", get(&p, "warm50")), ("ext4-buffered", get(&kb, "warm50"))]);
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
        let dir = std::env::temp_dir().join(format!("pwfs-bench-smoke-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        for row in &r.rows {
            for (col, v) in &row.values {
                assert!(v.is_finite() && *v > 0.0, "{} / {col} = {v}", row.name);
            }
        }
        assert_eq!(r.targets.len(), 3);
        let j = r.json();
        assert_eq!(j["rows"].as_array().unwrap().len(), r.rows.len());
        assert!(r.table().contains("cold 4K randread p50"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
