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
            Target::Pwfs(f) => f.write_all_at(buf, off).map_err(err("write")),
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

/// A personality on the kernel's file, from a cold cache: ops/s.
fn kernel_cell(s: &Setup, p: &str, size: usize) -> R<f64> {
    let k = KFile::open(&s.kpath, false, false).map_err(err("kernel file"))?;
    k.drop_cache();
    let rate = personality(&Target::Kernel(&k), p, size, s.file, s.dur, s.seed)?;
    k.drop_cache();
    Ok(rate)
}

/// One slice of a read personality: from a cold cache, random offsets from `seed` or
/// sequential from offset 0 (wrapping, untimed `cold` again, at the end), for `slice`;
/// operations per second.
fn read_slice(
    t: &Target<'_>,
    random: bool,
    size: usize,
    file: u64,
    slice: Duration,
    seed: u64,
    cold: &dyn Fn() -> R<()>,
) -> R<f64> {
    let mut buf = vec![0u8; size];
    let slots = file / size as u64 - 1;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut next = 0u64;
    let mut left = slice;
    let (mut ops, mut busy) = (0u64, Duration::ZERO);
    let mut start = Instant::now();
    loop {
        let spent = start.elapsed();
        if spent >= left {
            busy += spent;
            return Ok(ops as f64 / busy.as_secs_f64());
        }
        if !random && next >= slots {
            busy += spent;
            left -= spent;
            cold()?;
            next = 0;
            start = Instant::now();
            continue;
        }
        let off = if random { rng.gen_range(0..slots) } else { next } * size as u64;
        next += 1;
        t.read(&mut buf, off)?;
        ops += 1;
    }
}

/// Rounds of a read cell: every column runs a slice per round, in an order that
/// rotates, so that the machine's drift (large on this shared VM) falls on all
/// columns alike; a column's figure is the median of its slices, so that a slice hit
/// by a hiccup of the host does not move it. 3% differences are then measurable.
const ROUNDS: u32 = 10;

fn policy_config(cache: u64, policy: FetchPolicy) -> Config {
    Config { cache_bytes: cache, fetch: policy, ..Default::default() }
}

/// What every cell of a run shares: the image and the kernel's file, the cache and
/// file sizes, the time per cell and the seed.
struct Setup {
    image: std::path::PathBuf,
    kpath: std::path::PathBuf,
    cache: u64,
    file: u64,
    dur: Duration,
    seed: u64,
}

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<(Report, String)> {
    let _ = std::fs::create_dir_all(&o.dir);
    let device = crate::DeviceProbe::measure(&o.dir);
    // Cache and file: the file is 4× the cache, as in the paper.
    let (cache, dur) = match o.file_mib {
        0..=16 => (4 * MIB, Duration::from_millis(100)),
        17..=256 => (32 * MIB, Duration::from_millis(700)),
        _ => (64 * MIB, Duration::from_secs(2)),
    };
    let file = 4 * cache;
    for part in &o.only {
        if !PERSONALITIES.contains(&part.as_str()) && part != "fuse" {
            return Err(format!("unknown part of bench nbw: {part} (parts: {}, fuse)", PERSONALITIES.join(", ")));
        }
    }
    let wanted = |part: &str| o.only.is_empty() || o.only.iter().any(|w| w == part);
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
    let setup = Setup { image: image.clone(), kpath: kpath.clone(), cache, file, dur, seed: o.seed };
    let mut table: Vec<(String, usize, [f64; 5])> = Vec::new();
    // Read cells: each policy's ratio to Blocking, from the four reading at once.
    let mut paired: Vec<(String, usize, [f64; 3])> = Vec::new();
    for p in PERSONALITIES.into_iter().filter(|p| wanted(p)) {
        for &size in &SIZES {
            progress(&format!("{p} {size} B"));
            let row = if p == "randread" || p == "seqread" {
                let row = read_cell(&setup, p == "randread", size)?;
                let ratios = read_interleaved(&setup, p == "randread", size)?;
                paired.push((p.to_string(), size, ratios));
                row
            } else {
                let mut row = [0f64; 5];
                for (i, (_, policy)) in POLICIES.iter().enumerate() {
                    let fs: Fs = pwfs::mount_image(&image, policy_config(cache, *policy)).map_err(err("mount"))?;
                    let f = OpenOptions::new().read(true).write(true).open(&fs, "/data").map_err(err("open"))?;
                    fs.evict_cache().map_err(err("evict"))?;
                    row[i] = personality(&Target::Pwfs(&f), p, size, file, dur, o.seed)?;
                    drop(f);
                    fs.unmount().map_err(err("unmount"))?;
                }
                row[4] = kernel_cell(&setup, p, size)?;
                row
            };
            table.push((p.to_string(), size, row));
        }
    }
    // Through the FUSE mount: random 2 KiB writes by a program (pwrite on the mount),
    // every policy against ext4. Needs root and /dev/fuse.
    let fuse_row = if wanted("fuse") && pwfs_fuse::can_mount() {
        progress("randwrite 2048 B through the FUSE mount");
        Some(fuse_randwrite(&o.dir, &setup, 2048)?)
    } else {
        None
    };
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
        ratio_bases: vec!["Blocking".into(), "ext4".into()],
        device: Some(device),
        ..Default::default()
    };
    for (p, size, row) in &table {
        let vals: Vec<(&str, f64)> = cols.iter().copied().zip(row.iter().copied()).collect();
        r.row(&format!("{p} {size} B"), "ops/s", false, &vals);
    }
    let best_nbw = |p: &str, size: usize| -> Option<(f64, f64, f64)> {
        let row = &table.iter().find(|(q, s, _)| q == p && *s == size)?.2;
        Some((row[1].max(row[2]).max(row[3]), row[0], row[4]))
    };
    if let Some((b, blk, ext4)) = best_nbw("randwrite", 2048) {
        r.targets.push(("random 2 KiB writes, best NBW / Blocking".into(), b / blk, ">= 4".into(), b / blk >= 4.0));
        r.targets.push(("random 2 KiB writes, best NBW / ext4".into(), b / ext4, ">= 3".into(), b / ext4 >= 3.0));
    }
    if let Some((b, blk, _)) = best_nbw("seqwrite", 2048) {
        let t = ("sequential 2 KiB writes, best NBW / Blocking".into(), b / blk, ">= 1.5".into(), b / blk >= 1.5);
        r.targets.push(t);
    }
    for p in ["randread", "seqread"] {
        let ratios: Vec<(usize, [f64; 3])> = paired.iter().filter(|c| c.0 == p).map(|c| (c.1, c.2)).collect();
        if ratios.is_empty() {
            continue;
        }
        let worst =
            ratios.iter().flat_map(|c| c.1).fold(1.0f64, |w, x| if (x - 1.0).abs() > (w - 1.0).abs() { x } else { w });
        r.targets.push((
            format!("{p}: every policy within 3% of Blocking (interleaved; the ratio farthest from 1)"),
            worst,
            "0.97..1.03".into(),
            (worst - 1.0).abs() <= 0.03,
        ));
        let how = if p == "randread" { "operation by operation" } else { "4 MiB cold bursts" };
        let cells: Vec<String> =
            ratios.iter().map(|(size, v)| format!("{size} B {:.3}/{:.3}/{:.3}", v[0], v[1], v[2])).collect();
        r.notes.push(format!(
            "{p}, the four policies interleaved ({how}), ratio to Blocking (Async-FG/Async-BG/Lazy): {}",
            cells.join(", ")
        ));
    }
    if let Some(row) = fuse_row {
        let vals: Vec<(&str, f64)> = cols.iter().copied().zip(row.iter().copied()).collect();
        r.row("FUSE randwrite 2048 B", "ops/s", false, &vals);
        let best = row[1].max(row[2]).max(row[3]);
        r.targets.push((
            "FUSE mount: random 2 KiB writes, best NBW / ext4".into(),
            best / row[4],
            "> 1".into(),
            best > row[4],
        ));
    } else if wanted("fuse") {
        r.notes.push("FUSE row skipped: needs root and /dev/fuse".into());
    }
    r.notes.push("pwfs columns run through the Rust API with the given fetch policy (the FUSE row: a program's pwrite on the mount); ext4 is a buffered file on the same disk, cache dropped with POSIX_FADV_DONTNEED before each cell".into());
    r.notes.push(format!("write cells: one column after another, each from a cold cache; read cells: {ROUNDS} rounds of slices in rotating order, every slice from a cold cache (pwfs: a fresh mount of the same image), slice k of every column reading the same offsets; a read cell's figure is the median of its slices; the read targets compare the four policies interleaved, on 8 fresh sets of four mounts of the image (random reads: every offset read by the four in shuffled order, each operation timed; sequential: 4 MiB regions read cold by the four in shuffled order, the median over rounds of the ratio of burst times), so that the machine's drift falls on all four alike"));
    let svg = plot(&table, &cols);
    Ok((r, svg))
}

/// A read personality, interleaved: in every round each column runs one slice, in
/// an order that rotates. Every pwfs slice mounts the same image afresh with its
/// column's policy (cold, and the host's caching of the image file is the same for
/// every column), the kernel's slice starts with its cache dropped; slice k of every
/// column reads the same offsets.
fn read_cell(s: &Setup, random: bool, size: usize) -> R<[f64; 5]> {
    let Setup { image, kpath, cache, file, dur, seed } = s;
    let (cache, file, dur, seed) = (*cache, *file, *dur, *seed);
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); 5];
    let slice = dur / ROUNDS;
    for round in 0..ROUNDS as usize {
        let seed = seed + round as u64;
        for j in 0..5 {
            let c = (round + j) % 5;
            let rate = if c < 4 {
                // No fsck at mount: the image was checked when the run began.
                let config = Config { check_on_mount: pwfs::MountCheck::Never, ..policy_config(cache, POLICIES[c].1) };
                let fs = pwfs::mount_image(image, config).map_err(err("mount"))?;
                let f = OpenOptions::new().read(true).open(&fs, "/data").map_err(err("open"))?;
                let cold = || fs.evict_cache().map_err(err("evict"));
                let rate = read_slice(&Target::Pwfs(&f), random, size, file, slice, seed, &cold)?;
                // Readahead still in flight must not run into the next column's slice.
                cold()?;
                drop(f);
                fs.unmount().map_err(err("unmount"))?;
                rate
            } else {
                let k = KFile::open(kpath, false, false).map_err(err("kernel file"))?;
                k.drop_cache();
                let cold = || {
                    k.drop_cache();
                    Ok(())
                };
                read_slice(&Target::Kernel(&k), random, size, file, slice, seed, &cold)?
            };
            rates[c].push(rate);
        }
    }
    let mut row = [0f64; 5];
    for (v, r) in row.iter_mut().zip(rates) {
        *v = crate::median(r);
    }
    Ok(row)
}

/// A read personality under the four policies at once, to compare them within a few
/// percent on a machine whose device drifts far more than that between one moment and
/// the next (random 2 KiB reads: ±15% between 200 ms windows here). Each policy mounts
/// the image (four independent mounts of one image; none writes, so they need no lock
/// between them), all start cold. Random reads: one loop issues every operation to the
/// four in a shuffled order, timing each, so every policy reads the same offsets in the
/// same moment; a policy's rate is its operations over the time spent in them. Returns
/// the rate of Async-FG, Async-BG and Lazy relative to Blocking's. Sequential reads: a
/// burst at a time instead (a 4 MiB region read from its start, cold, by each policy in
/// shuffled order, with the readahead of each burst finished before the next starts),
/// because a policy's readahead would otherwise run on while the others are timed; the
/// ratio is the median over rounds of Blocking's burst time over the policy's in the
/// same round, so that neither the drift nor a hiccup of the host during one burst
/// lands on one policy.
fn read_interleaved(s: &Setup, random: bool, size: usize) -> R<[f64; 3]> {
    use pwfs::device::uring::{Lock, UringDevice, UringOptions};
    use rand::seq::SliceRandom;
    let (cache, file, dur, seed) = (s.cache, s.file, s.dur, s.seed);
    let mut buf = vec![0u8; size];
    let slots = file / size as u64 - 1;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut order = [0usize, 1, 2, 3];
    let (mut ops, mut busy) = (0u64, [Duration::ZERO; 4]);
    const REGION: u64 = 4 * MIB;
    let (regions, per_region) = ((file / REGION).max(1), REGION.min(file) / size as u64);
    let mut region = 0u64;
    let mut paired: [Vec<f64>; 3] = Default::default();
    // Random: as long as the four slices of a read cell together; sequential bursts
    // vary more, so twice as long. The time is split over fresh sets of mounts, so
    // that an effect of one mount (where its memory or threads landed) does not sit
    // on one policy for the whole cell.
    let total = if random { 4 * dur } else { 8 * dur };
    for _ in 0..GENERATIONS {
        // Mounted in a shuffled order too: none always gets the first memory or threads.
        let mut slots_of: Vec<Option<Fs>> = vec![None, None, None, None];
        let mut mount_order = [0usize, 1, 2, 3];
        mount_order.shuffle(&mut rng);
        for c in mount_order {
            let config = Config { check_on_mount: pwfs::MountCheck::Never, ..policy_config(cache, POLICIES[c].1) };
            let opts = UringOptions { lock: Lock::None, ..pwfs::device_options(&config) };
            let dev = UringDevice::open(&s.image, &opts).map_err(err("open the image"))?;
            slots_of[c] = Some(Fs::mount(std::sync::Arc::new(dev), config).map_err(err("mount"))?);
        }
        let mounts: Vec<Fs> = slots_of.into_iter().map(|m| m.expect("mounted")).collect();
        let files = mounts
            .iter()
            .map(|fs| OpenOptions::new().read(true).open(fs, "/data").map_err(err("open")))
            .collect::<R<Vec<pwfs::File>>>()?;
        let cold = || mounts.iter().try_for_each(|fs| fs.evict_cache().map_err(err("evict")));
        cold()?;
        let start = Instant::now();
        while start.elapsed() < total / GENERATIONS {
            order.shuffle(&mut rng);
            if random {
                let off = rng.gen_range(0..slots) * size as u64;
                for &c in &order {
                    let t = Instant::now();
                    files[c].read_at(&mut buf, off).map_err(err("read"))?;
                    busy[c] += t.elapsed();
                }
                ops += 1;
                continue;
            }
            let base = (region % regions) * REGION;
            region += 1;
            let mut took = [0f64; 4];
            for &c in &order {
                let t = Instant::now();
                for i in 0..per_region {
                    files[c].read_at(&mut buf, base + i * size as u64).map_err(err("read"))?;
                }
                took[c] = t.elapsed().as_secs_f64();
                // Untimed: its readahead finishes and its cache empties before the next burst.
                mounts[c].evict_cache().map_err(err("evict"))?;
            }
            for (c, v) in paired.iter_mut().enumerate() {
                v.push(took[0] / took[c + 1]);
            }
        }
        cold()?;
        drop(files);
        for fs in mounts {
            fs.unmount().map_err(err("unmount"))?;
        }
    }
    if !random {
        return Ok(paired.map(crate::median));
    }
    let rates = busy.map(|b| ops as f64 / b.as_secs_f64());
    Ok([rates[1] / rates[0], rates[2] / rates[0], rates[3] / rates[0]])
}

/// Fresh sets of mounts per interleaved read comparison.
const GENERATIONS: u32 = 8;

/// Random writes of `size` bytes by a program on a pwfs FUSE mount, one mount per
/// policy, then the same on ext4: ops/s per column.
fn fuse_randwrite(dir: &std::path::Path, s: &Setup, size: usize) -> R<[f64; 5]> {
    let mnt = dir.join("nbw-mnt");
    std::fs::create_dir_all(&mnt).map_err(err("mkdir"))?;
    let mut row = [0f64; 5];
    for (i, (_, policy)) in POLICIES.iter().enumerate() {
        let fs: Fs = pwfs::mount_image(&s.image, policy_config(s.cache, *policy)).map_err(err("mount"))?;
        let mounted = pwfs_fuse::mount(fs.clone(), &mnt, false).map_err(err("FUSE mount"))?;
        let k = KFile::open(&mnt.join("data"), false, false).map_err(err("open on the mount"))?;
        fs.evict_cache().map_err(err("evict"))?;
        row[i] = personality(&Target::Kernel(&k), "randwrite", size, s.file, s.dur, s.seed)?;
        drop(k);
        mounted.unmount().map_err(err("FUSE unmount"))?;
        fs.unmount().map_err(err("unmount"))?;
    }
    row[4] = kernel_cell(s, "randwrite", size)?;
    let _ = std::fs::remove_dir(&mnt);
    Ok(row)
}

/// Grouped bars, one panel per personality, log-scaled ops/s.
fn plot(table: &[(String, usize, [f64; 5])], cols: &[&str]) -> String {
    let colors = ["#888888", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e"];
    let (pw, ph, pad) = (560.0, 220.0, 50.0);
    let shown: Vec<&str> = PERSONALITIES.into_iter().filter(|p| table.iter().any(|r| r.0 == *p)).collect();
    let height = shown.len() as f64 * (ph + pad) + 60.0;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{height}' font-family='sans-serif' font-size='11'>\n",
        pw + 2.0 * pad
    );
    let max = table.iter().flat_map(|r| r.2).fold(1.0f64, f64::max).log10().ceil();
    for (k, p) in shown.iter().enumerate() {
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
            let Some((_, _, row)) = table.iter().find(|(q, z, _)| q == p && *z == size) else { continue };
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
        let _one_at_a_time = crate::smoke_lock();
        let dir = std::env::temp_dir().join(format!("pwfs-bench-nbw-{}", std::process::id()));
        let (r, svg) = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        let fuse = usize::from(pwfs_fuse::can_mount());
        assert_eq!(r.rows.len(), PERSONALITIES.len() * SIZES.len() + fuse);
        r.check_filled().unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("randwrite"));
        // Every cell relative to Blocking and to ext4, printed and in the JSON.
        let text = r.table();
        assert!(text.contains("relative to Blocking") && text.contains("relative to ext4"));
        let ratio = &r.json()["rows"][0]["ratios"];
        assert!(ratio["Blocking"]["Async-FG"].is_number() && ratio["ext4"]["Blocking"].is_number(), "{ratio}");
        // Both read targets come from the interleaved comparison, with a finite ratio.
        for p in ["randread", "seqread"] {
            let t = r.targets.iter().find(|t| t.0.starts_with(p)).expect("read target");
            assert!(t.1.is_finite() && t.1 > 0.0, "{t:?}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// `--only` runs the parts named and nothing else; an unknown part is refused.
    #[test]
    fn only_runs_the_parts_named() {
        let _one_at_a_time = crate::smoke_lock();
        let dir = std::env::temp_dir().join(format!("pwfs-bench-nbw-only-{}", std::process::id()));
        let opts = Opts { only: vec!["randread".into()], ..Opts::smoke(dir.clone()) };
        let (r, svg) = run(&opts, &mut |_| {}).unwrap();
        assert_eq!(r.rows.len(), SIZES.len());
        assert!(r.rows.iter().all(|row| row.name.starts_with("randread")));
        assert_eq!(r.targets.len(), 1);
        assert!(!svg.contains("randwrite"));
        let bad = Opts { only: vec!["randwrit".into()], ..Opts::smoke(dir.clone()) };
        assert!(run(&bad, &mut |_| {}).unwrap_err().contains("unknown part"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
