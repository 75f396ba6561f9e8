//! `pwfs`: make, check, inspect and benchmark Patchwork images.

use clap::{Parser, Subcommand, ValueEnum};
use pwfs::{Config, MkfsOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod control;
mod helper;
mod mount;
mod progress;

#[derive(Parser)]
#[command(name = "pwfs", version, about = "Patchwork: a user-space file system and I/O stack")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Format an image file (created and allocated up front) or a block device.
    Mkfs {
        image: PathBuf,
        /// Size of a new image: bytes, or with a K/M/G/T suffix (powers of 1024).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Number of inodes (default: one per 16 KiB).
        #[arg(long)]
        inodes: Option<u64>,
        /// Journal size in 4 KiB blocks (default: 1/64 of the image, 256..16384).
        #[arg(long)]
        journal_blocks: Option<u64>,
        /// Format even what already holds data (a pwfs image, another file system,
        /// anything but zeros in its first 64 KiB).
        #[arg(long, short = 'f')]
        force: bool,
    },
    /// Check every invariant of an image. Never repairs. Exits 0 if clean, 4 if
    /// damaged, 8 if it could not check (not a pwfs image, unreadable).
    Fsck { image: PathBuf },
    /// Print the superblock and usage of an image.
    Info { image: PathBuf },
    /// Mount an image with FUSE and serve it until Ctrl-C,
    /// SIGTERM or `pwfs umount`; then flush everything and empty the journal.
    Mount {
        /// Image file or block device.
        #[arg(default_value = DEFAULT_IMAGE)]
        image: PathBuf,
        /// Where to mount it (created if missing).
        #[arg(default_value = DEFAULT_MOUNTPOINT)]
        mountpoint: PathBuf,
        /// Create the image, of this size, if it does not exist (the default image,
        /// pwfs.img, is created at 1G without it; any other missing image is an error).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Bytes of file data Patchwork caches.
        #[arg(long, value_parser = parse_size, default_value = "256M")]
        cache: u64,
        /// Detach from the terminal once mounted.
        #[arg(long)]
        daemon: bool,
        /// Let other users than the mounting one use the file system.
        #[arg(long)]
        allow_other: bool,
        /// How a partial write to a page not in memory gets its data (non-blocking
        /// writes): blocking reads it first (the off-switch); the others patch it and
        /// fetch later.
        #[arg(long, value_enum, default_value = "async-bg")]
        fetch: Fetch,
        /// The I/O stack: async submits first and does the bookkeeping while the device
        /// works (a read miss, the commit of an fsync); sync waits for each step before
        /// the next (the off-switch).
        #[arg(long, value_enum, default_value = "async")]
        stack: StackArg,
        /// Hybrid polling: a thread waiting for the device spins for about one 4 KiB
        /// read's latency before it sleeps (lower latency, a busier core).
        #[arg(long, value_enum, default_value = "off")]
        poll: OnOff,
        /// Serve the LD_PRELOAD shim (libpwfs_preload.so): a program run with it
        /// reads and writes this mount's files through shared memory with this process
        /// instead of FUSE requests.
        #[arg(long, value_enum, default_value = "on")]
        shim: OnOff,
        /// Hitchhiking: a small write made durable by fsync/fdatasync rides as a
        /// compressed delta in the journal's commit block instead of costing a block
        /// write of its own (off: every fsync'd block is written whole).
        #[arg(long, value_enum, default_value = "on")]
        hitchhike: OnOff,
        /// FUSE over io_uring: where the kernel offers it (the fuse module's
        /// enable_uring parameter, Linux 6.14+), requests come through one ring entry per
        /// serving thread on per-CPU queues instead of /dev/fuse reads (off: /dev/fuse
        /// only).
        #[arg(long, value_enum, default_value = "on")]
        fuse_uring: OnOff,
        /// Run the full consistency check before mounting, even if the image was
        /// unmounted cleanly (it always runs when it was not).
        #[arg(long)]
        check: bool,
        /// What the kernel caches of file data: write-through keeps clean data in the
        /// kernel's page cache (a cached read is no request; writes reach Patchwork as
        /// made); off opens files for direct I/O (every read and write is a request,
        /// writes to one file run in parallel); write-back buffers writes in the kernel
        /// too (whole pages reach Patchwork later; a partial write to an uncached page
        /// reads it first).
        #[arg(long, value_enum, default_value = "write-through")]
        kernel_cache: KernelCache,
        /// Update access times on reads by the relatime rule (the mount shows relatime;
        /// by default it shows noatime and reads never change a file's metadata). Reads
        /// the kernel serves from its page cache do not reach Patchwork: exact access
        /// times need --kernel-cache off.
        #[arg(long)]
        atime: bool,
        /// Mount options as mount(8) takes them, applied after the flags above:
        /// cache=SIZE, fetch=POLICY, kernel_cache=MODE, fuse_uring=on|off, threads=N, check, allow_other, fsname=NAME,
        /// ro/rw, suid/nosuid, dev/nodev, exec/noexec, noatime, ... (see README).
        #[arg(short = 'o', long = "options")]
        options: Option<String>,
    },
    /// Install the mount(8) helper: DIR/mount.fuse.pwfs, a symbolic link to this binary,
    /// so that `mount -t fuse.pwfs IMAGE DIR` and fstab lines of type fuse.pwfs work.
    InstallHelper {
        #[arg(default_value = "/sbin")]
        dir: PathBuf,
    },
    /// Unmount a pwfs mount point (the serving process then flushes and exits).
    Umount { mountpoint: PathBuf },
    /// Live counters of a mounted pwfs (state, non-blocking writes, cache, journal).
    Stat { mountpoint: PathBuf },
    /// Make everything written to a mount durable, and return when it is (sync(1) does
    /// not reach a FUSE file system). Without MOUNTPOINT: every pwfs mount of this machine.
    Sync { mountpoint: Option<PathBuf> },
    /// Run a named benchmark (Patchwork against the kernel, side by side).
    Bench {
        #[arg(value_enum)]
        workload: Workload,
        /// About a minute: the README's first run.
        #[arg(long)]
        quick: bool,
        /// Seconds: only shows that the workload runs (CI).
        #[arg(long, conflicts_with = "quick")]
        smoke: bool,
        /// Directory for the image and the kernel's files (the disk under test).
        #[arg(long, default_value = "bench-out")]
        dir: PathBuf,
        /// Where to write the JSON record (default: DIR/WORKLOAD.json).
        #[arg(long)]
        json: Option<PathBuf>,
        /// Run these parts alone (comma-separated). aios: reads, threads, fsync, apps
        /// (RocksDB db_bench through a FUSE mount); apps: db_bench, sqlite, fio, pread;
        /// hitchhike: append, overwrite, varmail; nbw: seqwrite, randwrite, randrw, randread,
        /// seqread, fuse; scale: overwrite, read, create, smallwrite; fuse: untar, find,
        /// randwrite, cached, cold, appends, seq, git, fileserver, webproxy, varmail, randomrw.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Run nothing: draw the plot of `pwfs bench aios` from these JSON records
        /// (comma-separated; their rows merged, a later record's row winning) into
        /// aios.svg beside the first record.
        #[arg(long, value_delimiter = ',')]
        replot: Vec<PathBuf>,
    },
}

/// Where `--replot` writes: beside the first record.
fn cmd_dir_of(records: &[PathBuf]) -> Option<PathBuf> {
    records.first().and_then(|p| p.parent()).map(|d| d.to_path_buf())
}

/// The default image: in the current directory, created at 1 GiB when missing.
const DEFAULT_IMAGE: &str = "pwfs.img";
/// The default mount point.
const DEFAULT_MOUNTPOINT: &str = "/mnt/pwfs";

#[derive(Clone, Copy, ValueEnum)]
enum StackArg {
    Sync,
    Async,
}

#[derive(Clone, Copy, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, ValueEnum)]
enum Fetch {
    Blocking,
    AsyncFg,
    AsyncBg,
    Lazy,
}

impl From<Fetch> for pwfs::FetchPolicy {
    fn from(f: Fetch) -> Self {
        match f {
            Fetch::Blocking => pwfs::FetchPolicy::Blocking,
            Fetch::AsyncFg => pwfs::FetchPolicy::AsyncForeground,
            Fetch::AsyncBg => pwfs::FetchPolicy::AsyncBackground,
            Fetch::Lazy => pwfs::FetchPolicy::Lazy,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum KernelCache {
    Off,
    WriteThrough,
    WriteBack,
}

impl From<KernelCache> for pwfs_fuse::KernelCache {
    fn from(k: KernelCache) -> Self {
        match k {
            KernelCache::Off => pwfs_fuse::KernelCache::Off,
            KernelCache::WriteThrough => pwfs_fuse::KernelCache::WriteThrough,
            KernelCache::WriteBack => pwfs_fuse::KernelCache::WriteBack,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Workload {
    /// Asynchronous I/O stack: cold reads by size, reads by threads, write+fsync latency;
    /// Sync vs Async vs Async+polling vs ext4 and the raw device.
    Aios,
    /// db_bench, sqlite3, fio and cached 4 KiB pread latency on ext4, a FUSE mount, and
    /// the mount under the LD_PRELOAD shim ($PWFS_PRELOAD or libpwfs_preload.so beside pwfs).
    Apps,
    /// Cold/warm 4 KiB reads, write+fsync, 1 MiB sequential I/O vs ext4 and the raw device.
    Basic,
    /// Untar, random writes with fsync, reads, sequential I/O, git status: a FUSE mount vs ext4.
    Fuse,
    /// Small writes + fsync (appends, overwrites, varmail mix) by size with hitchhiking on
    /// and off vs ext4 and ext4 fast_commit: ops/s, latency, device I/O per op (+ SVG).
    Hitchhike,
    /// Non-blocking writes: personalities × I/O sizes under every fetch policy vs ext4 (+ SVG).
    Nbw,
    /// 1-8 threads: overwrites, shared cached reads, create+stat+unlink, small cached writes vs ext4.
    Scale,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        Some('T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?} (try 64M or 1G)"))?;
    n.checked_mul(mult).ok_or_else(|| format!("size too large: {s}"))
}

/// What the engine reports from its background threads (a failed write-back or
/// commit, a write lost to a failed fetch, a repaired superblock) goes to stderr:
/// warnings and errors, or what `PWFS_LOG` asks for (`info`, `debug`, `pwfs=trace`:
/// tracing's filter syntax). A daemon's stderr is its log file (`pwfs mount --daemon`).
fn log_to_stderr() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("PWFS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // No colours: a daemon's stderr becomes its log file after this.
        .with_ansi(false)
        .with_target(false)
        // A stderr that fails (a closed pipe, a full /run) drops the message: the
        // default reports the failure with eprintln!, which panics the logging thread.
        .log_internal_errors(false)
        .try_init();
}

fn main() -> ExitCode {
    log_to_stderr();
    if helper::called_as_helper() {
        return helper::main();
    }
    let cli = Cli::parse();
    // A command that only prints (info, fsck, stat) piped into `head` ends quietly on
    // SIGPIPE, as other tools do, instead of failing to print. Not the others (a mount
    // serves sockets whose peers may go away, a benchmark runs programs).
    if matches!(cli.cmd, Cmd::Info { .. } | Cmd::Fsck { .. } | Cmd::Stat { .. } | Cmd::Mkfs { .. }) {
        // SAFETY: setting a signal's disposition to the default; no handler is involved.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pwfs: {e}");
            ExitCode::from(2)
        }
    }
}

/// As mkfs.xfs and mkfs.btrfs without -f: an existing file or device whose first 64
/// KiB hold anything but zeros (a pwfs image, another file system, a document) is not
/// formatted over.
fn refuse_to_overwrite(image: &Path) -> Result<(), String> {
    use std::io::Read;
    let Ok(mut f) = std::fs::File::open(image) else { return Ok(()) };
    let mut head = vec![0u8; 64 << 10];
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(format!("{}: {e}", image.display())),
        }
    }
    if head[..n].iter().all(|b| *b == 0) {
        return Ok(());
    }
    let what = if n >= 8 && head[..8] == pwfs::format::SB_MAGIC.to_le_bytes() { "a pwfs file system" } else { "data" };
    Err(format!(
        "{} already holds {what}; `pwfs mkfs --force` formats it anew (everything on it is lost)",
        image.display()
    ))
}

fn run(cmd: Cmd) -> Result<ExitCode, String> {
    match cmd {
        Cmd::Mkfs { image, size, inodes, journal_blocks, force } => {
            let opts = MkfsOptions { inodes, journal_blocks };
            if !force {
                refuse_to_overwrite(&image)?;
            }
            let size = match size {
                Some(s) => s,
                None => match std::fs::metadata(&image) {
                    Ok(m) if m.file_type().is_file() && m.len() > 0 => m.len(),
                    Ok(m) if !m.file_type().is_file() => block_device_size(&image)?,
                    _ => return Err(format!("{}: no such image; give --size to create one", image.display())),
                },
            };
            let bar = progress::Bar::new("mkfs");
            let sb = pwfs::mkfs_image_with_progress(&image, size, &opts, &mut |d, t| bar.update(d, t))
                .map_err(|e| e.to_string())?;
            bar.finish();
            println!(
                "formatted {}: {} blocks of 4 KiB ({} MiB), {} inodes, journal {} blocks, uuid {}",
                image.display(),
                sb.total_blocks,
                (sb.total_blocks * 4096) >> 20,
                sb.inode_count,
                sb.journal_blocks,
                hex(&sb.uuid)
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Fsck { image } => {
            // Exit codes as fsck(8) has them: 0 clean, 4 problems left (pwfs never
            // repairs), 8 the check could not run.
            let operational = |e: String| {
                eprintln!("pwfs: {e}");
                Ok(ExitCode::from(8))
            };
            let config = Config { cache_bytes: 1 << 20, read_only: true, ..Default::default() };
            let dev = match pwfs::open_device(&image, &config) {
                Ok(dev) => dev,
                Err(e) => return operational(e.to_string()),
            };
            let bar = progress::Bar::new("fsck");
            let r = match pwfs::fsck::check_with_progress(&*dev, &mut |d, t| bar.update(d, t)) {
                Ok(r) => r,
                // Not a pwfs image at all: nothing to check (e2fsck's "bad magic", 8).
                Err(e) if e.kind() == pwfs::ErrorKind::Corrupt && !e.to_string().contains("not a pwfs image") => {
                    bar.finish();
                    println!("error: {e}");
                    println!("{}: damaged", image.display());
                    return Ok(ExitCode::from(4));
                }
                Err(e) => return operational(format!("{}: {e}", image.display())),
            };
            bar.finish();
            for n in &r.notes {
                println!("note: {n}");
            }
            for e in &r.errors {
                println!("error: {e}");
            }
            if !r.marked_clean {
                println!("note: not marked as unmounted cleanly (the next mount checks it first)");
            }
            println!(
                "{}: {} inodes ({} files, {} directories), {} data blocks in use: {}",
                image.display(),
                r.inodes_used,
                r.files,
                r.directories,
                r.blocks_used,
                if r.is_clean() { "clean".to_string() } else { format!("{} problem(s)", r.errors.len()) }
            );
            Ok(if r.is_clean() { ExitCode::SUCCESS } else { ExitCode::from(4) })
        }
        Cmd::Info { image } => {
            let config = Config {
                read_only: true,
                check_on_mount: pwfs::MountCheck::Never,
                writeback_interval: None,
                ..Default::default()
            };
            let fs = pwfs::mount_image(&image, config).map_err(|e| e.to_string())?;
            let sb = fs.superblock().clone();
            let st = fs.statfs();
            println!("image:          {}", image.display());
            println!("format version: {}", sb.version);
            println!("uuid:           {}", hex(&sb.uuid));
            println!("size:           {} blocks of 4 KiB ({} MiB)", sb.total_blocks, (sb.total_blocks * 4096) >> 20);
            println!("journal:        blocks {}..{}", sb.journal_start, sb.journal_start + sb.journal_blocks);
            println!(
                "inode bitmap:   blocks {}..{}",
                sb.inode_bitmap_start,
                sb.inode_bitmap_start + sb.inode_bitmap_blocks
            );
            println!(
                "block bitmap:   blocks {}..{}",
                sb.block_bitmap_start,
                sb.block_bitmap_start + sb.block_bitmap_blocks
            );
            println!("inode table:    blocks {}..{}", sb.inode_table_start, sb.data_start);
            println!("data:           blocks {}..{}", sb.data_start, sb.data_end);
            println!(
                "usage:          {} of {} data blocks used ({:.1}%), {} of {} inodes used",
                st.blocks - st.blocks_free,
                st.blocks,
                100.0 * (st.blocks - st.blocks_free) as f64 / st.blocks as f64,
                st.inodes - st.inodes_free,
                st.inodes
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Mount {
            image,
            mountpoint,
            size,
            cache,
            daemon,
            allow_other,
            fetch,
            stack,
            poll,
            shim,
            hitchhike,
            fuse_uring,
            check,
            kernel_cache,
            atime,
            options,
        } => {
            let mut opts = mount::MountOpts {
                cache: Some(cache),
                fetch: Some(fetch.into()),
                stack: Some(match stack {
                    StackArg::Sync => pwfs::Stack::Sync,
                    StackArg::Async => pwfs::Stack::Async,
                }),
                poll: Some(matches!(poll, OnOff::On)),
                shim: Some(matches!(shim, OnOff::On)),
                hitchhike: Some(matches!(hitchhike, OnOff::On)),
                fuse_uring: Some(matches!(fuse_uring, OnOff::On)),
                kernel_cache: Some(kernel_cache.into()),
                check,
                allow_other,
                atime: atime.then_some(true),
                ..Default::default()
            };
            if let Some(o) = options {
                helper::parse_options(&o, false, &mut opts)?;
                if opts.remount {
                    return Err("-o remount: use `mount -o remount,...` (or mount.fuse.pwfs) on a mount".into());
                }
            }
            // A mistyped path is not a new, empty file system: only the default image,
            // or one asked for with --size, is made.
            let create = size.is_some() || image == Path::new(DEFAULT_IMAGE);
            let size = size.unwrap_or(1 << 30);
            mount::run(&mount::MountArgs { image, mountpoint, size, daemon, create, opts })
        }
        Cmd::InstallHelper { dir } => {
            let link = helper::install(&dir)?;
            println!("installed {} -> {}", link.display(), std::fs::read_link(&link).unwrap_or_default().display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Stat { mountpoint } => {
            print!("{}", control::stat(&mountpoint)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Sync { mountpoint } => {
            match mountpoint {
                Some(mp) => control::sync(&mp)?,
                None => control::sync_all()?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Umount { mountpoint } => {
            mount::umount(&mountpoint)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { workload, replot, .. } if !replot.is_empty() => {
            if !matches!(workload, Workload::Aios) {
                return Err("--replot applies to `pwfs bench aios`".into());
            }
            let mut merged = pwfs_bench::report::Report::default();
            for path in &replot {
                let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let v: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                merged.merge(&v).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            let dir = match &cmd_dir_of(&replot) {
                Some(d) => d.clone(),
                None => PathBuf::from("."),
            };
            let plot = dir.join("aios.svg");
            std::fs::write(&plot, pwfs_bench::aios::plot(&merged)).map_err(|e| format!("{}: {e}", plot.display()))?;
            println!("plot: {}", plot.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { workload, quick, smoke, dir, json, only, replot: _ } => {
            let mut opts = if smoke {
                pwfs_bench::Opts::smoke(dir.clone())
            } else if quick {
                pwfs_bench::Opts::quick(dir.clone())
            } else {
                pwfs_bench::Opts::full(dir.clone())
            };
            if !only.is_empty()
                && !matches!(
                    workload,
                    Workload::Aios
                        | Workload::Apps
                        | Workload::Hitchhike
                        | Workload::Nbw
                        | Workload::Scale
                        | Workload::Fuse
                )
            {
                return Err("--only applies to `pwfs bench aios`, `pwfs bench apps`, `pwfs bench hitchhike`, \
                            `pwfs bench nbw`, `pwfs bench scale` and `pwfs bench fuse`"
                    .into());
            }
            opts.only = only;
            let name = match workload {
                Workload::Aios => "aios",
                Workload::Apps => "apps",
                Workload::Basic => "basic",
                Workload::Fuse => "fuse",
                Workload::Hitchhike => "hitchhike",
                Workload::Scale => "scale",
                Workload::Nbw => "nbw",
            };
            let mut steps = progress::Steps::new(&format!("bench {name}"));
            let mut step = |s: &str| steps.step(s);
            let r = match workload {
                Workload::Aios => pwfs_bench::aios::run(&opts, &mut step).map(|r| {
                    let svg = pwfs_bench::aios::plot(&r);
                    (r, Some(svg))
                }),
                Workload::Apps => pwfs_bench::apps::run(&opts, &mut step).map(|r| (r, None)),
                Workload::Basic => pwfs_bench::basic::run(&opts, &mut step).map(|r| (r, None)),
                Workload::Fuse => pwfs_bench::fuse::run(&opts, &mut step).map(|r| (r, None)),
                Workload::Hitchhike => pwfs_bench::hitchhike::run(&opts, &mut step).map(|r| {
                    let svg = pwfs_bench::hitchhike::plot(&r);
                    (r, Some(svg))
                }),
                Workload::Scale => pwfs_bench::scale::run(&opts, &mut step).map(|r| (r, None)),
                Workload::Nbw => pwfs_bench::nbw::run(&opts, &mut step).map(|(r, svg)| (r, Some(svg))),
            };
            steps.finish();
            let (r, svg) = r?;
            // The record first: a closed stdout (`| head`) must not lose an hour's run.
            let json = json.unwrap_or_else(|| dir.join(format!("{name}.json")));
            std::fs::write(&json, serde_json_pretty(&r)).map_err(|e| format!("{}: {e}", json.display()))?;
            let mut text = String::new();
            if let Some(svg) = svg {
                let plot = dir.join(format!("{name}.svg"));
                std::fs::write(&plot, svg).map_err(|e| format!("{}: {e}", plot.display()))?;
                text += &format!("plot: {}\n", plot.display());
            }
            text += &r.table();
            text += &format!("JSON record: {}\n", json.display());
            use std::io::Write;
            let _ = std::io::stdout().write_all(text.as_bytes());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn serde_json_pretty(r: &pwfs_bench::Report) -> String {
    format!("{:#}\n", r.json())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn block_device_size(path: &PathBuf) -> Result<u64, String> {
    use std::io::Seek;
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.seek(std::io::SeekFrom::End(0)).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
