//! `pwfs bench nbw`: the non-blocking-writes experiment of the paper (Filebench
//! personalities on a file at least 4× the cache, started cold), in one run: columns
//! Blocking, Async-FG, Async-BG, Lazy (pwfs through its Rust API) and ext4 buffered
//! (the kernel, a file on the same disk). Operations per second for every personality
//! and I/O size, ratios to Blocking and to ext4, and an SVG plot.

use crate::kernel::KFile;
use crate::{Opts, Report};
use pwfs::device::AlignedBuf;
use pwfs::{Config, FetchPolicy, Fs, MkfsOptions, OpenOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

type R<T> = Result<T, String>;
const MIB: u64 = 1 << 20;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

pub const SIZES: [usize; 6] = [128, 512, 1024, 2048, 3072, 4096];
pub const PERSONALITIES: [&str; 5] = ["seqwrite", "randwrite", "randrw", "randread", "seqread"];
const POLICIES: [(&str, FetchPolicy); 4] = [
    ("Blocking", FetchPolicy::Blocking),
    ("Async-FG", FetchPolicy::AsyncForeground),
    ("Async-BG", FetchPolicy::AsyncBackground),
    ("Lazy", FetchPolicy::Lazy),
];

/// One file under test: pwfs (through its API) or the kernel's.
enum Target<'a> {
    Pwfs(&'a pwfs::File),
    Kernel(&'a KFile),
}

impl Target<'_> {
    fn write(&self, buf: &[u8], off: u64) -> R<()> {
        match self {
            Target::Pwfs(f) => f.write_at(buf, off).map(|_| ()).map_err(err("write")),
            Target::Kernel(f) => {
                use std::os::unix::fs::FileExt;
                f.file.write_all_at(buf, off).map_err(err("pwrite"))
            }
        }
    }
    fn read(&self, buf: &mut [u8], off: u64) -> R<()> {
        match self {
            Target::Pwfs(f) => f.read_at(buf, off).map(|_| ()).map_err(err("read")),
            Target::Kernel(f) => {
                use std::os::unix::fs::FileExt;
                f.file.read_exact_at(buf, off).map_err(err("pread"))
            }
        }
    }
}

/// Run one personality for `dur`; operations per second.
fn personality(t: &Target<'_>, name: &str, size: usize, file: u64, dur: Duration, seed: u64) -> R<f64> {
    let ops = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let body = |writer: bool, random: bool, seed: u64| -> R<()> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut buf = vec![0x5au8; size];
        // Unaligned offsets, so that every write is a partial write of some page.
        let slots = file / size as u64 - 1;
        let mut next = 0u64;
        let start = Instant::now();
        while !stop.load(Ordering::Relaxed) && start.elapsed() < dur {
            // Sequential runs stop at the end of the file rather than wrap: a second
            // pass would be served from whatever cache kept the first.
            if !random && next >= slots {
                break;
            }
            let off = if random { rng.gen_range(0..slots) * size as u64 } else { next * size as u64 };
            next += 1;
            if writer {
                t.write(&buf, off)?;
            } else {
                t.read(&mut buf, off)?;
            }
            ops.fetch_add(1, Ordering::Relaxed);
        }
        stop.store(true, Ordering::Relaxed);
        Ok(())
    };
    let t0 = Instant::now();
    match name {
        "seqwrite" => body(true, false, seed)?,
        "randwrite" => body(true, true, seed)?,
        "randread" => body(false, true, seed)?,
        "seqread" => body(false, false, seed)?,
        "randrw" => std::thread::scope(|s| -> R<()> {
            let r = s.spawn(|| body(false, true, seed));
            body(true, true, seed + 1)?;
            r.join().map_err(|_| "reader panicked".to_string())?
        })?,
        _ => return Err(format!("unknown personality {name}")),
    }
    Ok(ops.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64())
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<(Report, String)> {
    // Cache and file: the file is 4× the cache, as in the paper.
    let (cache, dur) = match o.file_mib {
        0..=16 => (4 * MIB, Duration::from_millis(100)),
        17..=256 => (32 * MIB, Duration::from_millis(700)),
        _ => (64 * MIB, Duration::from_secs(2)),
    };
    let file = 4 * cache;
    std::fs::create_dir_all(&o.dir).map_err(err("create bench dir"))?;
    let image = o.dir.join("nbw.img");
    let kpath = o.dir.join("nbw-kernel.dat");
    progress("preparing the image and the kernel's file");
    let _ = std::fs::remove_file(&image);
    pwfs::mkfs_image(&image, file + 256 * MIB, &MkfsOptions::default()).map_err(err("mkfs"))?;
    {
        let fs = pwfs::mount_image(&image, Config::default()).map_err(err("mount"))?;
        fs.write_file("/data", &vec![1u8; file as usize]).map_err(err("fill"))?;
        fs.unmount().map_err(err("unmount"))?;
        let k = KFile::open(&kpath, false, true).map_err(err("kernel file"))?;
        let mut chunk = AlignedBuf::new(MIB as usize);
        chunk.fill(1);
        for i in 0..file / MIB {
            k.pwrite(&chunk, i * MIB).map_err(err("pwrite"))?;
        }
        k.fsync().map_err(err("fsync"))?;
    }
    let mut table: Vec<(String, usize, [f64; 5])> = Vec::new();
    for p in PERSONALITIES {
        for &size in &SIZES {
            progress(&format!("{p} {size} B"));
            let mut row = [0f64; 5];
            for (i, (_, policy)) in POLICIES.iter().enumerate() {
                let config = Config { cache_bytes: cache, fetch: *policy, ..Default::default() };
                let fs: Fs = pwfs::mount_image(&image, config).map_err(err("mount"))?;
                let f = OpenOptions::new().read(true).write(true).open(&fs, "/data").map_err(err("open"))?;
                fs.evict_cache().map_err(err("evict"))?;
                row[i] = personality(&Target::Pwfs(&f), p, size, file, dur, o.seed)?;
                drop(f);
                fs.unmount().map_err(err("unmount"))?;
            }
            let k = KFile::open(&kpath, false, false).map_err(err("kernel file"))?;
            k.drop_cache();
            row[4] = personality(&Target::Kernel(&k), p, size, file, dur, o.seed)?;
            k.drop_cache();
            table.push((p.to_string(), size, row));
        }
    }
    let _ = std::fs::remove_file(&image);
    let _ = std::fs::remove_file(&kpath);

    let cols = ["Blocking", "Async-FG", "Async-BG", "Lazy", "ext4"];
    let mut r = Report {
        title: format!(
            "pwfs bench nbw: {} MiB file (4x the {} MiB cache), cold start, {} ms per cell, ops/s",
            file / MIB,
            cache / MIB,
            dur.as_millis()
        ),
        columns: cols.iter().map(|c| c.to_string()).collect(),
        ..Default::default()
    };
    for (p, size, row) in &table {
        let vals: Vec<(&str, f64)> = cols.iter().copied().zip(row.iter().copied()).collect();
        r.row(&format!("{p} {size} B"), "ops/s", false, &vals);
    }
    let best_nbw = |p: &str, size: usize| -> (f64, f64, f64) {
        let row = &table.iter().find(|(q, s, _)| q == p && *s == size).expect("measured").2;
        (row[1].max(row[2]).max(row[3]), row[0], row[4])
    };
    let (b, blk, ext4) = best_nbw("randwrite", 2048);
    r.targets.push(("random 2 KiB writes, best NBW / Blocking".into(), b / blk, ">= 4".into(), b / blk >= 4.0));
    r.targets.push(("random 2 KiB writes, best NBW / ext4".into(), b / ext4, ">= 3".into(), b / ext4 >= 3.0));
    let (b, blk, _) = best_nbw("seqwrite", 2048);
    r.targets.push(("sequential 2 KiB writes, best NBW / Blocking".into(), b / blk, ">= 1.5".into(), b / blk >= 1.5));
    for p in ["randread", "seqread"] {
        let worst = SIZES
            .iter()
            .map(|&s| {
                let row = &table.iter().find(|(q, z, _)| q == p && *z == s).expect("measured").2;
                row[1..4].iter().map(|v| v / row[0]).fold(f64::INFINITY, f64::min)
            })
            .fold(f64::INFINITY, f64::min);
        r.targets.push((
            format!("{p}: every policy within 3% of Blocking (worst ratio)"),
            worst,
            ">= 0.97".into(),
            worst >= 0.97,
        ));
    }
    r.notes.push("pwfs columns run through the Rust API with the given fetch policy; ext4 is a buffered file on the same disk, cache dropped with POSIX_FADV_DONTNEED before each cell".into());
    let svg = plot(&table, &cols);
    Ok((r, svg))
}

/// Grouped bars, one panel per personality, log-scaled ops/s.
fn plot(table: &[(String, usize, [f64; 5])], cols: &[&str]) -> String {
    let colors = ["#888888", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e"];
    let (pw, ph, pad) = (560.0, 220.0, 50.0);
    let height = PERSONALITIES.len() as f64 * (ph + pad) + 60.0;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{height}' font-family='sans-serif' font-size='11'>\n",
        pw + 2.0 * pad
    );
    let max = table.iter().flat_map(|r| r.2).fold(1.0f64, f64::max).log10().ceil();
    for (k, p) in PERSONALITIES.iter().enumerate() {
        let y0 = 30.0 + k as f64 * (ph + pad);
        s += &format!(
            "<text x='{pad}' y='{}' font-size='13' font-weight='bold'>{p} (ops/s, log scale)</text>\n",
            y0 - 8.0
        );
        s += &format!("<rect x='{pad}' y='{y0}' width='{pw}' height='{ph}' fill='none' stroke='#ccc'/>\n");
        for d in 0..=(max as i32) {
            let y = y0 + ph - ph * d as f64 / max;
            s += &format!("<text x='{}' y='{}' text-anchor='end'>1e{d}</text>\n", pad - 4.0, y + 4.0);
        }
        let group = pw / SIZES.len() as f64;
        for (j, &size) in SIZES.iter().enumerate() {
            let row = &table.iter().find(|(q, z, _)| q == p && *z == size).expect("measured").2;
            let bw = group * 0.8 / cols.len() as f64;
            for (c, v) in row.iter().enumerate() {
                let h = ph * (v.max(1.0).log10() / max);
                let x = pad + j as f64 * group + group * 0.1 + c as f64 * bw;
                s += &format!(
                    "<rect x='{x:.1}' y='{:.1}' width='{:.1}' height='{h:.1}' fill='{}'><title>{} {size} B: {v:.0}</title></rect>\n",
                    y0 + ph - h,
                    bw - 1.0,
                    colors[c],
                    cols[c]
                );
            }
            s += &format!(
                "<text x='{:.1}' y='{}' text-anchor='middle'>{size} B</text>\n",
                pad + j as f64 * group + group / 2.0,
                y0 + ph + 14.0
            );
        }
    }
    for (c, name) in cols.iter().enumerate() {
        let x = pad + c as f64 * 100.0;
        s += &format!(
            "<rect x='{x}' y='{}' width='10' height='10' fill='{}'/><text x='{}' y='{}'>{name}</text>\n",
            height - 20.0,
            colors[c],
            x + 14.0,
            height - 11.0
        );
    }
    s += "</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke run fills every cell and writes a plot.
    #[test]
    fn smoke_run_fills_the_table() {
        let dir = std::env::temp_dir().join(format!("pwfs-bench-nbw-{}", std::process::id()));
        let (r, svg) = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        assert_eq!(r.rows.len(), PERSONALITIES.len() * SIZES.len());
        r.check_filled().unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("randwrite"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
