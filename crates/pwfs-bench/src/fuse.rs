//! `pwfs bench fuse`: the same workloads on Patchwork FUSE mounts and on ext4 on this
//! disk, alternating between them in every run. Needs root (FUSE mount). Columns:
//! `pwfs` (the default mount: the kernel caches clean data, writes go through),
//! `pwfs-direct` (`--kernel-cache off`: every read and write is a request),
//! `pwfs-wback` (`--kernel-cache write-back`: the kernel buffers writes too),
//! `pwfs-uring` (the default mount with the fuse module's `enable_uring` turned on for it,
//! so served through FUSE over io_uring where the kernel has it; back to what it was
//! after the run) and `ext4`. The first three are mounted as this machine mounts them,
//! through /dev/fuse unless `enable_uring` is on already; the notes say what served each.
//!
//! Cold reads: Patchwork's cache is evicted through the engine, the kernel's dropped
//! with POSIX_FADV_DONTNEED (on ext4 and on the FUSE file).

use crate::memcg;
use crate::personalities::{self, Personality};
use crate::{median, percentiles, shuffled_pages, Opts, Report};
use pwfs::{Config, Fs, MkfsOptions};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

type R<T> = Result<T, String>;
const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

fn err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn syncfs(dir: &Path) -> R<()> {
    let f = File::open(dir).map_err(err("open dir"))?;
    // SAFETY: plain syscall on an fd we own.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(format!("syncfs: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn drop_kernel_cache(path: &Path) {
    if let Ok(f) = File::open(path) {
        // SAFETY: plain syscalls on an fd we own.
        unsafe {
            libc::fdatasync(f.as_raw_fd());
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}

fn run_cmd(cmd: &mut Command) -> R<()> {
    let out = cmd.output().map_err(err("spawn"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

/// What an equal-memory cell's workload process needs for itself, on both sides, beside
/// the page cache the cgroup is there to equalise: the webproxy-like cell's 100 threads
/// (stacks, buffers, the forked bench's pages they write) and the kernel's inodes and
/// dentries of 10,000 files take about 128 MiB, which left a direct-I/O mount's clients
/// (no page cache to reclaim) at their limit and killed by the OOM killer now and then.
const WORKLOAD_MEMORY: u64 = 128 * MIB;

/// One side of the comparison: a directory, and the engine behind it if it is ours.
struct Side {
    name: &'static str,
    dir: PathBuf,
    fs: Option<Fs>,
}

impl Side {
    fn cold(&self, file: &Path) -> R<()> {
        if let Some(fs) = &self.fs {
            fs.evict_cache().map_err(err("evict"))?;
        }
        drop_kernel_cache(file);
        Ok(())
    }
}

struct Sizes {
    seq_mib: u64,
    rand_mib: u64,
    writes: usize,
    reads: usize,
    git_files: usize,
    /// Cached random reads per measurement, and appends of 100 bytes.
    cached_reads: usize,
    appends: usize,
}

fn untar(side: &Side, tarball: &Path, run: usize) -> R<f64> {
    let to = side.dir.join(format!("untar{run}"));
    std::fs::create_dir_all(&to).map_err(err("mkdir"))?;
    let t = Instant::now();
    run_cmd(Command::new("tar").arg("-C").arg(&to).arg("-xf").arg(tarball))?;
    syncfs(&side.dir)?;
    let s = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&to).map_err(err("cleanup"))?;
    Ok(s)
}

fn rand_writes(side: &Side, s: &Sizes, seed: u64) -> R<f64> {
    let path = side.dir.join("rand.dat");
    let f = OpenOptions::new().read(true).write(true).open(&path).map_err(err("open"))?;
    let page = vec![0xabu8; PAGE as usize];
    let t = Instant::now();
    for (i, p) in shuffled_pages(s.rand_mib * MIB / PAGE, s.writes, seed).into_iter().enumerate() {
        f.write_all_at(&page, p * PAGE).map_err(err("pwrite"))?;
        if i % 64 == 63 {
            f.sync_all().map_err(err("fsync"))?;
        }
    }
    f.sync_all().map_err(err("fsync"))?;
    Ok(s.writes as f64 / t.elapsed().as_secs_f64())
}

fn rand_reads(side: &Side, s: &Sizes, seed: u64) -> R<Vec<f64>> {
    let path = side.dir.join("rand.dat");
    side.cold(&path)?;
    let f = File::open(&path).map_err(err("open"))?;
    let mut buf = vec![0u8; PAGE as usize];
    let mut lat = Vec::with_capacity(s.reads);
    for p in shuffled_pages(s.rand_mib * MIB / PAGE, s.reads, seed) {
        let t = Instant::now();
        f.read_exact_at(&mut buf, p * PAGE).map_err(err("pread"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(lat)
}

fn seq(side: &Side, s: &Sizes) -> R<(f64, f64)> {
    let path = side.dir.join("seq.dat");
    let chunk = vec![0x5au8; MIB as usize];
    let t = Instant::now();
    let mut f = File::create(&path).map_err(err("create"))?;
    for _ in 0..s.seq_mib {
        f.write_all(&chunk).map_err(err("write"))?;
    }
    f.sync_all().map_err(err("fsync"))?;
    let w = s.seq_mib as f64 / t.elapsed().as_secs_f64();
    drop(f);
    side.cold(&path)?;
    let f = File::open(&path).map_err(err("open"))?;
    let mut buf = vec![0u8; MIB as usize];
    let t = Instant::now();
    for i in 0..s.seq_mib {
        f.read_exact_at(&mut buf, i * MIB).map_err(err("read"))?;
    }
    let r = s.seq_mib as f64 / t.elapsed().as_secs_f64();
    std::fs::remove_file(&path).map_err(err("rm"))?;
    Ok((w, r))
}

/// 4 KiB random reads of a file read once before (fio psync on a warm file): ops/s.
fn cached_reads(side: &Side, s: &Sizes, seed: u64) -> R<f64> {
    let path = side.dir.join("rand.dat");
    let f = File::open(&path).map_err(err("open"))?;
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..s.rand_mib {
        f.read_exact_at(&mut buf, i * MIB).map_err(err("warm"))?;
    }
    let pages = shuffled_pages(s.rand_mib * MIB / PAGE, s.cached_reads, seed);
    let t = Instant::now();
    for p in pages {
        f.read_exact_at(&mut buf[..PAGE as usize], p * PAGE).map_err(err("pread"))?;
    }
    Ok(s.cached_reads as f64 / t.elapsed().as_secs_f64())
}

/// Records of 100 bytes appended with write(2), no sync (a write-ahead log without
/// sync, as RocksDB's fillseq writes it): ops/s.
fn small_appends(side: &Side, s: &Sizes) -> R<f64> {
    let path = side.dir.join("wal.log");
    let _ = std::fs::remove_file(&path);
    let mut f = OpenOptions::new().create(true).append(true).open(&path).map_err(err("open"))?;
    let rec = [0x42u8; 100];
    let t = Instant::now();
    for _ in 0..s.appends {
        f.write_all(&rec).map_err(err("append"))?;
    }
    let r = s.appends as f64 / t.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&path).map_err(err("rm"))?;
    Ok(r)
}

/// `find` over the untarred tree, stat of every entry, warm: ms.
fn find_tree(side: &Side) -> R<f64> {
    let tree = side.dir.join("tree");
    let walk = || run_cmd(Command::new("find").arg(&tree).args(["-printf", "%s %m\\n"]));
    walk()?;
    let t = Instant::now();
    walk()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn git_setup(side: &Side, s: &Sizes) -> R<()> {
    let repo = side.dir.join("repo");
    std::fs::create_dir_all(&repo).map_err(err("mkdir"))?;
    for d in 0..s.git_files.div_ceil(100) {
        let sub = repo.join(format!("d{d}"));
        std::fs::create_dir_all(&sub).map_err(err("mkdir"))?;
        for i in 0..100.min(s.git_files - d * 100) {
            std::fs::write(sub.join(format!("f{i}.txt")), format!("{d} {i}\n")).map_err(err("write"))?;
        }
    }
    let git = |args: &[&str]| {
        let mut c = Command::new("git");
        c.arg("-C").arg(&repo).args(["-c", "user.name=bench", "-c", "user.email=bench@example.com"]).args(args);
        run_cmd(&mut c)
    };
    git(&["init", "-q"])?;
    git(&["add", "."])?;
    git(&["commit", "-qm", "files"])?;
    Ok(())
}

fn git_status(side: &Side) -> R<f64> {
    let t = Instant::now();
    run_cmd(Command::new("git").arg("-C").arg(side.dir.join("repo")).args(["status", "--porcelain"]))?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// What `--only` takes besides the personalities' names.
const PARTS: [&str; 8] = ["untar", "find", "randwrite", "cached", "cold", "appends", "seq", "git"];

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    for part in &o.only {
        let persona = Personality::ALL.iter().any(|p| p.name() == part);
        if !PARTS.contains(&part.as_str()) && !persona {
            let names: Vec<&str> = Personality::ALL.iter().map(|p| p.name()).collect();
            return Err(format!(
                "unknown part of bench fuse: {part} (parts: {}, {})",
                PARTS.join(", "),
                names.join(", ")
            ));
        }
    }
    let wanted = |part: &str| o.only.is_empty() || o.only.iter().any(|w| w == part);
    let _ = std::fs::create_dir_all(&o.dir);
    let device = crate::DeviceProbe::measure(&o.dir);
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        return Err("pwfs bench fuse mounts a file system: run it as root".into());
    }
    let s = if o.file_mib <= 16 {
        Sizes { seq_mib: 16, rand_mib: 16, writes: 256, reads: 100, git_files: 300, cached_reads: 2000, appends: 2000 }
    } else if o.file_mib <= 256 {
        Sizes {
            seq_mib: 256,
            rand_mib: 64,
            writes: 2048,
            reads: o.ops,
            git_files: 10_000,
            cached_reads: 100_000,
            appends: 100_000,
        }
    } else {
        Sizes {
            seq_mib: 1024,
            rand_mib: 256,
            writes: 8192,
            reads: o.ops,
            git_files: 10_000,
            cached_reads: 400_000,
            appends: 400_000,
        }
    };
    std::fs::create_dir_all(&o.dir).map_err(err("create bench dir"))?;
    let ext4 = o.dir.join("fuse-ext4");
    let _ = std::fs::remove_dir_all(&ext4);
    std::fs::create_dir_all(&ext4).map_err(err("mkdir"))?;
    progress("preparing the images and the source tarball");
    // The first three as this machine mounts them (FUSE over io_uring only where the
    // fuse module's enable_uring is on already); the fourth with it turned on.
    let modes = [
        ("pwfs", pwfs_fuse::KernelCache::WriteThrough, false),
        ("pwfs-direct", pwfs_fuse::KernelCache::Off, false),
        ("pwfs-wback", pwfs_fuse::KernelCache::WriteBack, false),
        ("pwfs-uring", pwfs_fuse::KernelCache::WriteThrough, true),
    ];
    let mut mounts = Vec::new();
    let mut sides = Vec::new();
    let mut param = None;
    for (name, cache, uring) in modes {
        if uring {
            param = Some(pwfs_fuse::EnableUring::on().map_err(|e| format!("{}: {e}", pwfs_fuse::ENABLE_URING)));
        }
        let image = o.dir.join(format!("{name}.img"));
        let mnt = o.dir.join(format!("{name}-mnt"));
        std::fs::create_dir_all(&mnt).map_err(err("mkdir"))?;
        let _ = std::fs::remove_file(&image);
        pwfs::mkfs_image(&image, (s.seq_mib + s.rand_mib + 1024) * MIB, &MkfsOptions::default())
            .map_err(err("mkfs"))?;
        let config = Config { cache_bytes: crate::basic::CACHE_BYTES, ..Default::default() };
        let fs = pwfs::mount_image(&image, config).map_err(err("mount image"))?;
        let options = pwfs_fuse::MountOptions { allow_other: false, kernel_cache: cache, ..Default::default() };
        let mounted = pwfs_fuse::mount_with(fs.clone(), &mnt, &options).map_err(err("FUSE mount"))?;
        mounts.push((mounted, fs.clone(), image));
        sides.push(Side { name, dir: mnt, fs: Some(fs) });
    }
    // Kept on until the mounts are gone: a connection whose ring is ready but whose
    // io_uring flag a refused registration cleared needs it (DECISIONS).
    let param_result = param.as_ref().map_or(Ok(()), |p| p.as_ref().map(drop).map_err(Clone::clone));
    sides.push(Side { name: "ext4", dir: ext4.clone(), fs: None });
    let tarball = o.dir.join("src.tar");
    run_cmd(Command::new("tar").arg("-C").arg("/usr").arg("-cf").arg(&tarball).arg("include"))?;
    let result = (|| -> R<Report> {
        for side in &sides {
            let mut f = File::create(side.dir.join("rand.dat")).map_err(err("create"))?;
            let chunk = vec![1u8; MIB as usize];
            for _ in 0..s.rand_mib {
                f.write_all(&chunk).map_err(err("write"))?;
            }
            f.sync_all().map_err(err("fsync"))?;
            git_setup(side, &s)?;
            let tree = side.dir.join("tree");
            std::fs::create_dir_all(&tree).map_err(err("mkdir"))?;
            run_cmd(Command::new("tar").arg("-C").arg(&tree).arg("-xf").arg(&tarball))?;
        }
        let n = sides.len();
        let mut untar_s = vec![Vec::new(); n];
        let mut find_ms = vec![Vec::new(); n];
        let mut wops = vec![Vec::new(); n];
        let mut cached = vec![Vec::new(); n];
        let mut appends = vec![Vec::new(); n];
        let mut seqw = vec![Vec::new(); n];
        let mut seqr = vec![Vec::new(); n];
        let mut git_ms = vec![Vec::new(); n];
        let mut reads = vec![Vec::new(); n];
        let mut persona = vec![vec![Vec::new(); n]; Personality::ALL.len()];
        let mut persona_all = vec![Vec::new(); Personality::ALL.len()];
        let load_of = |p: Personality| match o.file_mib {
            0..=16 => p.smoke(),
            17..=256 => p.quick(),
            _ => p.full(),
        };
        // Rows whose file set is larger than pwfs's cache measure memory as much as the
        // mount: each side gets the same (see the note the report carries).
        let memory_bound = |load: &personalities::Load| load.files as u64 * load.file_bytes > crate::basic::CACHE_BYTES;
        let mut limit_err = None;
        let limits = if Personality::ALL.iter().any(|&p| wanted(p.name()) && memory_bound(&load_of(p))) {
            let client = crate::basic::CACHE_BYTES + WORKLOAD_MEMORY;
            match memcg::Limit::new(client)
                .and_then(|a| Ok((a, memcg::Limit::new(client + crate::basic::CACHE_BYTES)?)))
            {
                Ok(l) => Some(l),
                Err(e) => {
                    limit_err = Some(e);
                    None
                }
            }
        } else {
            None
        };
        for run in 0..o.runs {
            progress(&format!("run {} of {}", run + 1, o.runs));
            // Each workload visits the sides in turn, starting from another side in
            // every run.
            let order: Vec<usize> = (0..n).map(|i| (i + run) % n).collect();
            if wanted("untar") {
                for &i in &order {
                    untar_s[i].push(untar(&sides[i], &tarball, run)?);
                }
            }
            if wanted("find") {
                for &i in &order {
                    find_ms[i].push(find_tree(&sides[i])?);
                }
            }
            if wanted("randwrite") {
                for &i in &order {
                    wops[i].push(rand_writes(&sides[i], &s, o.seed + run as u64)?);
                }
            }
            if wanted("cached") {
                for &i in &order {
                    cached[i].push(cached_reads(&sides[i], &s, o.seed + 50 + run as u64)?);
                }
            }
            if wanted("cold") {
                for &i in &order {
                    reads[i].extend(rand_reads(&sides[i], &s, o.seed + 100 + run as u64)?);
                }
            }
            if wanted("appends") {
                for &i in &order {
                    appends[i].push(small_appends(&sides[i], &s)?);
                }
            }
            if wanted("seq") {
                for &i in &order {
                    let (w, r) = seq(&sides[i], &s)?;
                    seqw[i].push(w);
                    seqr[i].push(r);
                }
            }
            if wanted("git") {
                for &i in &order {
                    git_status(&sides[i])?; // warm the metadata caches
                    git_ms[i].push(git_status(&sides[i])?);
                }
            }
            for (k, p) in Personality::ALL.into_iter().enumerate() {
                if !wanted(p.name()) {
                    continue;
                }
                let load = load_of(p);
                let cell = |dir: &Path| -> R<f64> {
                    personalities::prepare(p, dir, &load)?;
                    syncfs(dir)?;
                    let v = personalities::run(p, dir, &load)?;
                    personalities::cleanup(p, dir)?;
                    Ok(v)
                };
                let bound = memory_bound(&load);
                for &i in &order {
                    progress(&format!("run {} of {}: {}-like on {}", run + 1, o.runs, p.name(), sides[i].name));
                    let dir = &sides[i].dir;
                    persona[k][i].push(match (bound, &limits) {
                        (true, Some((pwfs, kernel))) => {
                            // Far past any cell's time: only a hung child meets it.
                            let timeout = load.duration * 6 + Duration::from_secs(1800);
                            if sides[i].fs.is_some() { pwfs } else { kernel }.run(timeout, || cell(dir))?
                        }
                        _ => cell(dir)?,
                    });
                    if bound && limits.is_some() && sides[i].fs.is_none() {
                        // The kernel with all of the machine's memory, for the record.
                        persona_all[k].push(cell(dir)?);
                    }
                }
            }
        }
        let mut r = Report {
            title: format!(
                "pwfs bench fuse: pwfs FUSE mounts (kernel cache write-through, off, write-back; write-through over \
                 FUSE over io_uring) vs ext4 on the same disk, \
                 median of {} runs (pwfs cache {} MiB)",
                o.runs,
                crate::basic::CACHE_BYTES / MIB
            ),
            columns: sides.iter().map(|s| s.name.to_string()).collect(),
            device: Some(device),
            ..Default::default()
        };
        let cols = |v: &[Vec<f64>]| -> Vec<(&str, f64)> {
            sides.iter().zip(v).map(|(side, v)| (side.name, median(v.clone()))).collect()
        };
        let untar_row = "untar /usr/include + syncfs";
        let find_row = "find -printf %s of that tree, warm";
        let cached_row = "cached 4K random read (psync)";
        let cold_row = "cold 4K random read p50";
        let append_row = "100 B appends, no sync";
        // Only the rows of the parts that ran, and the targets on them.
        let row = |r: &mut Report, part: &str, name: &str, unit: &'static str, lower: bool, v: &[(&str, f64)]| {
            if wanted(part) {
                r.row(name, unit, lower, v);
            }
        };
        row(&mut r, "untar", untar_row, "s", true, &cols(&untar_s));
        row(&mut r, "find", find_row, "ms", true, &cols(&find_ms));
        let wrow = format!("4K random write, fsync/64 ({} MiB file)", s.rand_mib);
        row(&mut r, "randwrite", &wrow, "ops/s", false, &cols(&wops));
        row(&mut r, "cached", cached_row, "ops/s", false, &cols(&cached));
        let pct: Vec<(f64, f64)> = reads.iter().map(|v| percentiles(v.clone())).collect();
        let p50: Vec<(&str, f64)> = sides.iter().zip(&pct).map(|(side, p)| (side.name, p.0)).collect();
        let p99: Vec<(&str, f64)> = sides.iter().zip(&pct).map(|(side, p)| (side.name, p.1)).collect();
        row(&mut r, "cold", cold_row, "us", true, &p50);
        row(&mut r, "cold", "cold 4K random read p99", "us", true, &p99);
        row(&mut r, "appends", append_row, "ops/s", false, &cols(&appends));
        row(&mut r, "seq", &format!("seq write 1M x {} + fsync", s.seq_mib), "MB/s", false, &cols(&seqw));
        row(&mut r, "seq", "seq read 1M cold", "MB/s", false, &cols(&seqr));
        row(&mut r, "git", &format!("git status, {} files (warm)", s.git_files), "ms", true, &cols(&git_ms));
        let mut persona_rows = Vec::new();
        for (k, p) in Personality::ALL.into_iter().enumerate() {
            if !wanted(p.name()) {
                continue;
            }
            let load = load_of(p);
            let equal = memory_bound(&load) && limits.is_some();
            let name =
                format!("{}-like, {} threads{}", p.name(), load.threads, if equal { ", equal memory" } else { "" });
            r.row(&name, "ops/s", false, &cols(&persona[k]));
            if !persona_all[k].is_empty() {
                let all = format!("{}-like, {} threads, ext4 with all memory", p.name(), load.threads);
                r.row(&all, "ops/s", false, &[("ext4", median(persona_all[k].clone()))]);
            }
            persona_rows.push((p, name));
        }
        r.ratio_bases.push("ext4".into());
        r.target("cached reads", cached_row, "pwfs", "ext4", None, Some(0.7));
        r.target("cold reads (latency: pwfs / ext4)", cold_row, "pwfs", "ext4", Some(1.0 / 0.7), None);
        r.target("untar (time)", untar_row, "pwfs", "ext4", Some(1.3), None);
        r.target("find (time)", find_row, "pwfs", "ext4", Some(1.3), None);
        for (p, name) in &persona_rows {
            let at_least = match p {
                Personality::WebProxy => 0.7,
                Personality::FileServer | Personality::VarMail => 0.6,
                Personality::RandomRw => 0.5,
            };
            r.target(p.name(), name, "pwfs", "ext4", None, Some(at_least));
        }
        r.notes.push("pwfs / best kernel: for times, > 1 means pwfs is slower".into());
        // What serves each mount: the ring entries its session settled on.
        let transports: Vec<String> = sides
            .iter()
            .zip(&mounts)
            .map(|(side, (m, _, _))| match m.ring_entries() {
                0 => format!("{} /dev/fuse", side.name),
                n => format!("{} FUSE over io_uring ({n} ring entries)", side.name),
            })
            .collect();
        let uring_note = match &param_result {
            Ok(()) => format!("transport (enable_uring set to Y for pwfs-uring): {}", transports.join(", ")),
            Err(e) => format!("transport: {} ({e})", transports.join(", ")),
        };
        r.notes.push(uring_note);
        match &limits {
            Some((pwfs, kernel)) if Personality::ALL.iter().any(|&p| wanted(p.name()) && memory_bound(&load_of(p))) => {
                r.notes.push(format!(
                    "rows marked 'equal memory' (a file set larger than pwfs's {} MiB cache) run each side's workload \
                     in a child process in a memory cgroup: {} MiB for a pwfs mount's clients (their kernel page \
                     cache, and {} MiB for the workload's own threads and buffers) on top of pwfs's own cache, {} MiB \
                     for ext4; the row after each gives ext4 with all of the machine's memory",
                    crate::basic::CACHE_BYTES / MIB,
                    pwfs.bytes() / MIB,
                    WORKLOAD_MEMORY / MIB,
                    kernel.bytes() / MIB
                ));
                r.notes.push("other rows: ext4 runs with all of the machine's memory for its page cache".into());
            }
            _ => match &limit_err {
                Some(e) => r.notes.push(format!(
                    "ext4 runs with all of the machine's memory for its page cache, on every row: no memory \
                     cgroup here ({e})"
                )),
                None => r.notes.push("ext4 runs with all of the machine's memory for its page cache".into()),
            },
        }
        Ok(r)
    })();
    drop(sides);
    for (mounted, fs, image) in mounts {
        let _ = mounted.unmount();
        let _ = fs.unmount();
        let _ = std::fs::remove_file(&image);
    }
    drop(param);
    let _ = std::fs::remove_file(&tarball);
    let _ = std::fs::remove_dir_all(&ext4);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smoke run completes (as root with /dev/fuse; elsewhere it says so).
    #[test]
    fn smoke_run_fills_the_table() {
        let _one_at_a_time = crate::smoke_lock();
        if !pwfs_fuse::can_mount() {
            eprintln!("skipping: needs root and /dev/fuse");
            return;
        }
        let dir = std::env::temp_dir().join(format!("pwfs-bench-fuse-{}", std::process::id()));
        let r = run(&Opts::smoke(dir.clone()), &mut |_| {}).unwrap();
        r.check_filled().unwrap();
        assert_eq!(r.rows.len(), 14);
        assert_eq!(r.targets.len(), 8, "every target found its row");
        assert_eq!(r.columns, ["pwfs", "pwfs-direct", "pwfs-wback", "pwfs-uring", "ext4"]);
        // `--only` runs the parts named, and refuses a name it does not know.
        let only = Opts { only: vec!["find".into(), "varmail".into()], ..Opts::smoke(dir.clone()) };
        let r = run(&only, &mut |_| {}).unwrap();
        r.check_filled().unwrap();
        let rows: Vec<&str> = r.rows.iter().map(|row| row.name.as_str()).collect();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert!(rows[0].starts_with("find") && rows[1].starts_with("varmail"), "{rows:?}");
        assert_eq!(r.targets.len(), 2);
        let bad = Opts { only: vec!["fileservr".into()], ..Opts::smoke(dir.clone()) };
        assert!(run(&bad, &mut |_| {}).unwrap_err().contains("unknown part"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
