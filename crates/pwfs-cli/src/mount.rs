//! `pwfs mount` and `pwfs umount`.

use pwfs::{Config, MkfsOptions};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::FromRawFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc;

enum Event {
    Signal,
    Unmounted(std::io::Result<()>),
}

/// Block SIGINT/SIGTERM/SIGHUP in this thread and every thread it starts later; a
/// dedicated thread takes them with sigwait.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on a zeroed, initialised set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Fork; the parent waits until the child reports the mount and exits with its
/// status. Returns the pipe the child reports on.
fn daemonize() -> Result<std::fs::File, String> {
    let mut fds = [0; 2];
    // SAFETY: pipe/fork/setsid before any thread exists (called first thing).
    unsafe {
        if libc::pipe(fds.as_mut_ptr()) != 0 {
            return Err(format!("pipe: {}", std::io::Error::last_os_error()));
        }
        match libc::fork() {
            -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
            0 => {
                libc::close(fds[0]);
                libc::setsid();
                Ok(std::fs::File::from_raw_fd(fds[1]))
            }
            _ => {
                libc::close(fds[1]);
                let mut r = std::fs::File::from_raw_fd(fds[0]);
                let mut msg = String::new();
                let _ = r.read_to_string(&mut msg);
                if let Some(out) = msg.strip_prefix("ok") {
                    print!("{out}");
                    std::process::exit(0);
                }
                eprint!("{msg}");
                std::process::exit(2);
            }
        }
    }
}

pub struct MountArgs {
    pub image: PathBuf,
    pub mountpoint: PathBuf,
    pub size: u64,
    pub cache: u64,
    pub daemon: bool,
    pub allow_other: bool,
    pub fetch: pwfs::FetchPolicy,
    /// Run the full check even on an image unmounted cleanly.
    pub check: bool,
    pub kernel_cache: pwfs_fuse::KernelCache,
}

pub fn run(a: &MountArgs) -> Result<ExitCode, String> {
    let mut report = if a.daemon { Some(daemonize()?) } else { None };
    let result = serve(a, &mut report);
    if let (Err(e), Some(p)) = (&result, report.as_mut()) {
        // The waiting parent prints it and exits non-zero.
        let _ = writeln!(p, "pwfs: {e}");
        std::process::exit(2);
    }
    result
}

fn serve(a: &MountArgs, report: &mut Option<std::fs::File>) -> Result<ExitCode, String> {
    let (image, mountpoint, size, cache, allow_other) = (&a.image, &a.mountpoint, a.size, a.cache, a.allow_other);
    let set = block_signals();
    let mut out = String::new();
    if !image.exists() {
        let sb = pwfs::mkfs_image(image, size, &MkfsOptions::default()).map_err(|e| e.to_string())?;
        out += &format!("created {} ({} MiB)\n", image.display(), (sb.total_blocks * 4096) >> 20);
    }
    std::fs::create_dir_all(mountpoint).map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    // Named before the mount, while the mount point resolves without us.
    let (stats_path, sock_path) = (stats_file(mountpoint), socket_file(mountpoint));
    let check_on_mount = if a.check { pwfs::MountCheck::Always } else { pwfs::MountCheck::IfNotClean };
    let config = Config { cache_bytes: cache, fetch: a.fetch, check_on_mount, ..Default::default() };
    let fs = pwfs::mount_image(image, config).map_err(|e| format!("{}: {e}", image.display()))?;
    // The control socket (`pwfs sync`, `pwfs stat`) answers before the mount appears, so
    // whoever sees the mount can sync it. Without it the mount still serves.
    let control = match crate::control::Server::start(sock_path.clone(), fs.clone()) {
        Ok(s) => Some(s),
        Err(e) => {
            out += &format!(
                "pwfs: warning: no control socket, `pwfs sync` cannot reach this mount ({}: {e})\n",
                sock_path.display()
            );
            None
        }
    };
    let options = pwfs_fuse::MountOptions { allow_other, kernel_cache: a.kernel_cache };
    let mounted = pwfs_fuse::mount_with(fs.clone(), mountpoint, &options)
        .map_err(|e| format!("mount at {}: {e}", mountpoint.display()))?;
    out += &format!(
        "pwfs: {} mounted at {}; Ctrl-C, SIGTERM or `pwfs umount {}` unmounts\n",
        image.display(),
        mountpoint.display(),
        mountpoint.display()
    );
    match report.take() {
        Some(mut p) => {
            let _ = write!(p, "ok{out}");
            // SAFETY: detach stdio from the terminal; /dev/null stands in.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                for fd in 0..3 {
                    libc::dup2(null, fd);
                }
            }
        }
        None => print!("{out}"),
    }
    // Live counters for `pwfs stat` without the socket, rewritten every second.
    let (fs2, path2) = (fs.clone(), stats_path.clone());
    std::thread::spawn(move || loop {
        if let Some(dir) = path2.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = std::fs::write(&path2, render_stats(&fs2));
        std::thread::sleep(std::time::Duration::from_secs(1));
    });
    let (tx, rx) = mpsc::channel();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        let _ = tx2.send(Event::Unmounted(mounted.join()));
    });
    std::thread::spawn(move || loop {
        let mut sig = 0;
        // SAFETY: waits for one of the signals blocked above.
        if unsafe { libc::sigwait(&set, &mut sig) } == 0 && tx.send(Event::Signal).is_err() {
            return;
        }
    });
    let mut served = Ok(());
    loop {
        match rx.recv() {
            Ok(Event::Signal) => {
                if let Err(e) = umount(mountpoint) {
                    eprintln!("pwfs: {e}; retrying when the next signal arrives");
                }
            }
            Ok(Event::Unmounted(r)) => {
                served = r;
                break;
            }
            Err(_) => break,
        }
    }
    drop(control);
    let _ = std::fs::remove_file(&stats_path);
    served.map_err(|e| format!("serving {}: {e}", mountpoint.display()))?;
    fs.unmount().map_err(|e| format!("flushing {} at unmount: {e}", image.display()))?;
    eprintln!("pwfs: {} unmounted; data flushed, journal empty", mountpoint.display());
    Ok(ExitCode::SUCCESS)
}

/// Unmount a FUSE mount point (root: umount2; otherwise fusermount3 -u).
pub fn umount(mountpoint: &Path) -> Result<(), String> {
    let c = CString::new(mountpoint.as_os_str().as_bytes()).map_err(|_| "mount point contains NUL".to_string())?;
    // SAFETY: plain syscall with a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        let st = std::process::Command::new("fusermount3").arg("-u").arg(mountpoint).status();
        if st.is_ok_and(|s| s.success()) {
            return Ok(());
        }
    }
    Err(format!("cannot unmount {}: {e}", mountpoint.display()))
}

/// Where serving processes keep their live counters and control sockets.
pub const RUN_DIR: &str = "/run/pwfs";

/// `RUN_DIR/<mount point, '/' as '%'>.EXT`.
fn runtime_file(mountpoint: &Path, ext: &str) -> PathBuf {
    // A mount whose serving process was killed does not resolve (ENOTCONN); its parent does.
    let canon = mountpoint.canonicalize().unwrap_or_else(|_| {
        let parent = mountpoint.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        match (parent.canonicalize(), mountpoint.file_name()) {
            (Ok(p), Some(name)) => p.join(name),
            _ => mountpoint.to_path_buf(),
        }
    });
    let name: String = canon.to_string_lossy().chars().map(|c| if c == '/' { '%' } else { c }).collect();
    Path::new(RUN_DIR).join(format!("{name}.{ext}"))
}

/// Where the serving process of `mountpoint` keeps its live counters.
fn stats_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "stats")
}

/// The control socket of the serving process of `mountpoint` (see `control`).
pub fn socket_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "sock")
}

/// The mount point a file in RUN_DIR is named after (for messages: a '%' in the mount
/// point's own name comes back as '/').
pub fn mountpoint_of(file: &Path) -> PathBuf {
    let stem = file.file_stem().unwrap_or_default().to_string_lossy();
    PathBuf::from(stem.replace('%', "/"))
}

pub fn render_stats(fs: &pwfs::Fs) -> String {
    let state = match fs.poisoned() {
        Some(why) => format!("read-only after an error: {}", why.replace('\n', " ")),
        None if fs.config().read_only => "read-only".to_string(),
        None => "read-write".to_string(),
    };
    let interval = match fs.config().writeback_interval {
        Some(d) if d.subsec_nanos() == 0 => format!("{}s", d.as_secs()),
        Some(d) => format!("{}ms", d.as_millis()),
        None => "none (only fsync, pwfs sync and unmount commit)".to_string(),
    };
    let n = fs.nbw_stats();
    let (hits, misses, evictions) = fs.cache_stats();
    let j = fs.journal_stats();
    format!(
        "state                 {state}\n\
         commit interval       {interval}\n\
         fetch policy          {:?}\n\
         patches created       {}\n\
         patches merged        {}\n\
         fetches avoided       {}\n\
         fetches deferred      {}\n\
         reads from patches    {}\n\
         patch-memory fallbacks {}\n\
         partial-write fetches {}\n\
         patch bytes now       {}\n\
         cache hits/misses     {hits}/{misses}\n\
         cache evictions       {evictions}\n\
         journal commits       {}\n\
         journal checkpoints   {}\n",
        fs.config().fetch,
        n.patches_created,
        n.patches_merged,
        n.fetches_avoided,
        n.fetches_deferred,
        n.reads_from_patches,
        n.patch_memory_fallbacks,
        n.partial_write_fetches,
        n.patch_bytes,
        j.commits,
        j.checkpoints,
    )
}

/// The counters the serving process of `mountpoint` last wrote.
pub fn stat_file(mountpoint: &Path) -> Result<String, String> {
    let p = stats_file(mountpoint);
    std::fs::read_to_string(&p)
        .map_err(|e| format!("{}: no pwfs mounted there ({}: {e})", mountpoint.display(), p.display()))
}
