//! `pwfs bench fuse`: the same workloads on a Patchwork FUSE mount and on ext4 on
//! this disk, alternating between the two in every run. Needs root (FUSE mount).
//!
//! Cold reads: Patchwork's cache is evicted through the engine, the kernel's dropped
//! with POSIX_FADV_DONTNEED (on ext4 and, for the mount, on the FUSE file, which keeps
//! no data cache since files are opened with direct I/O).

use crate::{median, percentiles, shuffled_pages, Opts, Report};
use pwfs::{Config, Fs, MkfsOptions};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

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

/// One side of the comparison: a directory, and the engine behind it if it is ours.
struct Side {
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

pub fn run(o: &Opts, progress: &mut dyn FnMut(&str)) -> R<Report> {
    let _ = std::fs::create_dir_all(&o.dir);
    let device = crate::DeviceProbe::measure(&o.dir);
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        return Err("pwfs bench fuse mounts a file system: run it as root".into());
    }
    let s = if o.file_mib <= 16 {
        Sizes { seq_mib: 16, rand_mib: 16, writes: 256, reads: 100, git_files: 300 }
    } else if o.file_mib <= 256 {
        Sizes { seq_mib: 256, rand_mib: 64, writes: 2048, reads: o.ops, git_files: 10_000 }
    } else {
        Sizes { seq_mib: 1024, rand_mib: 256, writes: 8192, reads: o.ops, git_files: 10_000 }
    };
    std::fs::create_dir_all(&o.dir).map_err(err("create bench dir"))?;
    let image = o.dir.join("fuse.img");
    let mnt = o.dir.join("fuse-mnt");
    let ext4 = o.dir.join("fuse-ext4");
    let _ = std::fs::remove_dir_all(&ext4);
    std::fs::create_dir_all(&mnt).map_err(err("mkdir"))?;
    std::fs::create_dir_all(&ext4).map_err(err("mkdir"))?;
    progress("preparing the image and the source tarball");
    let _ = std::fs::remove_file(&image);
    pwfs::mkfs_image(&image, (s.seq_mib + s.rand_mib + 1024) * MIB, &MkfsOptions::default()).map_err(err("mkfs"))?;
    let config = Config { cache_bytes: crate::basic::CACHE_BYTES, ..Default::default() };
    let fs = pwfs::mount_image(&image, config).map_err(err("mount image"))?;
    let mounted = pwfs_fuse::mount(fs.clone(), &mnt, false).map_err(err("FUSE mount"))?;
    let tarball = o.dir.join("src.tar");
    run_cmd(Command::new("tar").arg("-C").arg("/usr").arg("-cf").arg(&tarball).arg("include"))?;
    let sides = [Side { dir: mnt.clone(), fs: Some(fs.clone()) }, Side { dir: ext4.clone(), fs: None }];
    let result = (|| -> R<Report> {
        for side in &sides {
            let mut f = File::create(side.dir.join("rand.dat")).map_err(err("create"))?;
            let chunk = vec![1u8; MIB as usize];
            for _ in 0..s.rand_mib {
                f.write_all(&chunk).map_err(err("write"))?;
            }
            f.sync_all().map_err(err("fsync"))?;
            git_setup(side, &s)?;
        }
        let mut untar_s = [Vec::new(), Vec::new()];
        let mut wops = [Vec::new(), Vec::new()];
        let mut seqw = [Vec::new(), Vec::new()];
        let mut seqr = [Vec::new(), Vec::new()];
        let mut git_ms = [Vec::new(), Vec::new()];
        let mut reads = [Vec::new(), Vec::new()];
        for run in 0..o.runs {
            progress(&format!("run {} of {}", run + 1, o.runs));
            for (i, side) in sides.iter().enumerate() {
                untar_s[i].push(untar(side, &tarball, run)?);
            }
            for (i, side) in sides.iter().enumerate() {
                wops[i].push(rand_writes(side, &s, o.seed + run as u64)?);
            }
            for (i, side) in sides.iter().enumerate() {
                reads[i].extend(rand_reads(side, &s, o.seed + 100 + run as u64)?);
            }
            for (i, side) in sides.iter().enumerate() {
                let (w, r) = seq(side, &s)?;
                seqw[i].push(w);
                seqr[i].push(r);
            }
            for (i, side) in sides.iter().enumerate() {
                git_status(side)?; // warm the metadata caches
                git_ms[i].push(git_status(side)?);
            }
        }
        let mut r = Report {
            title: format!(
                "pwfs bench fuse: pwfs FUSE mount vs ext4 on the same disk, median of {} runs (pwfs cache {} MiB)",
                o.runs,
                crate::basic::CACHE_BYTES / MIB
            ),
            columns: vec!["pwfs".into(), "ext4".into()],
            device: Some(device),
            ..Default::default()
        };
        let two = |v: &[Vec<f64>; 2]| [("pwfs", median(v[0].clone())), ("ext4", median(v[1].clone()))];
        r.row("untar /usr/include + syncfs", "s", true, &two(&untar_s));
        r.row(&format!("4K random write, fsync/64 ({} MiB file)", s.rand_mib), "ops/s", false, &two(&wops));
        let (p0, p1) = (percentiles(reads[0].clone()), percentiles(reads[1].clone()));
        r.row("cold 4K random read p50", "us", true, &[("pwfs", p0.0), ("ext4", p1.0)]);
        r.row("cold 4K random read p99", "us", true, &[("pwfs", p0.1), ("ext4", p1.1)]);
        r.row(&format!("seq write 1M x {} + fsync", s.seq_mib), "MB/s", false, &two(&seqw));
        r.row("seq read 1M cold", "MB/s", false, &two(&seqr));
        r.row(&format!("git status, {} files (warm)", s.git_files), "ms", true, &two(&git_ms));
        r.notes.push("ratios in the last column are pwfs / ext4 (for times, > 1 means pwfs is slower)".into());
        Ok(r)
    })();
    drop(sides);
    let _ = mounted.unmount();
    let _ = fs.unmount();
    let _ = std::fs::remove_file(&image);
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
        assert_eq!(r.rows.len(), 7);
        let _ = std::fs::remove_dir_all(dir);
    }
}
