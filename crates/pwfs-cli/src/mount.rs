//! `pwfs mount` and `pwfs umount`.

use pwfs::{Config, MkfsOptions};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
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

/// A daemon's stderr, where the engine's warnings and errors go, is the mount's log
/// file (`log_file`), from before the mount on; a failure to mount also reaches the
/// waiting parent through its pipe.
fn log_to_file(mountpoint: &Path) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let log = runtime_dir(Path::new(RUN_DIR)).and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(log_file(mountpoint))
    });
    // Without a log (no /run/pwfs for this user), /dev/null: the caller's stderr must
    // not stay open in the daemon (a `$(pwfs mount --daemon ...)` would wait for ever).
    let fd = match &log {
        Ok(log) => log.as_raw_fd(),
        // SAFETY: open(2) of a constant path.
        Err(_) => unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) },
    };
    if fd >= 0 {
        // SAFETY: dup2 of a descriptor this process holds onto its stderr.
        unsafe { libc::dup2(fd, 2) };
    }
}

/// Fork; the parent waits until the child reports the mount and exits with its
/// status. Returns the pipe the child reports on.
/// `failed`: the waiting parent's exit code when the mount fails (mount(8)'s 32 for
/// the mount helper).
fn daemonize(failed: i32, log: &Path) -> Result<std::fs::File, String> {
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
                if msg.is_empty() {
                    eprintln!("pwfs: the serving process exited before it mounted; see {}", log.display());
                } else {
                    eprint!("{msg}");
                }
                std::process::exit(failed);
            }
        }
    }
}

/// What `-o` (and `pwfs mount`'s flags) choose; `None`: the default.
#[derive(Clone, Debug, Default)]
pub struct MountOpts {
    pub cache: Option<u64>,
    pub fetch: Option<pwfs::FetchPolicy>,
    /// The I/O stack (mechanism 4): `stack=sync|async`.
    pub stack: Option<pwfs::Stack>,
    /// Hybrid polling of completions: `poll=on|off`.
    pub poll: Option<bool>,
    /// Serve the LD_PRELOAD shim (`shim=on|off`; default on).
    pub shim: Option<bool>,
    /// Hitchhiking of small synchronous writes (`hitchhike=on|off`; default on).
    pub hitchhike: Option<bool>,
    pub kernel_cache: Option<pwfs_fuse::KernelCache>,
    /// FUSE over io_uring where the kernel offers it: `fuse_uring=on|off`.
    pub fuse_uring: Option<bool>,
    /// Run the full check even on an image unmounted cleanly.
    pub check: bool,
    pub allow_other: bool,
    /// The mount's source in /proc/mounts (default: the image's path).
    pub fsname: Option<String>,
    pub suid: bool,
    pub dev: bool,
    /// mount(2) flags (MS_RDONLY, MS_NOEXEC, MS_NOATIME, ...).
    pub flags: libc::c_ulong,
    /// `-o remount` (the mount helper only).
    pub remount: bool,
    /// Threads serving requests (`threads=N`; default `pwfs_fuse::default_threads`).
    pub threads: Option<usize>,
    /// Access times on reads (`atime`, `relatime`, `strictatime`: the relatime rule);
    /// `None` or `Some(false)`: noatime, shown in /proc/mounts.
    pub atime: Option<bool>,
}

pub struct MountArgs {
    pub image: PathBuf,
    pub mountpoint: PathBuf,
    /// Size of the image if it has to be created.
    pub size: u64,
    pub daemon: bool,
    /// Create a missing image (`pwfs mount`); the mount helper refuses instead.
    pub create: bool,
    pub opts: MountOpts,
}

pub fn run(a: &MountArgs) -> Result<ExitCode, String> {
    // The mount helper answers mount(8): 32 is "mount failure".
    let failed = if a.create { 2 } else { 32 };
    let mut report = if a.daemon { Some(daemonize(failed, &log_file(&a.mountpoint))?) } else { None };
    if report.is_some() {
        log_to_file(&a.mountpoint);
    }
    let result = serve(a, &mut report);
    if let (Err(e), Some(p)) = (&result, report.as_mut()) {
        // The waiting parent prints it and exits non-zero.
        let _ = writeln!(p, "pwfs: {e}");
        std::process::exit(failed);
    }
    result
}

fn serve(a: &MountArgs, report: &mut Option<std::fs::File>) -> Result<ExitCode, String> {
    let (image, mountpoint, o) = (&a.image, &a.mountpoint, &a.opts);
    let set = block_signals();
    let mut out = String::new();
    // An image this call made is removed again if the mount fails (it is no use, and
    // the next try would take it for a damaged one).
    let mut made = None;
    if !image.exists() {
        if !a.create {
            return Err(format!(
                "{}: no such image (`pwfs mkfs IMAGE --size SIZE` makes one, or give --size)",
                image.display()
            ));
        }
        if std::fs::symlink_metadata(image).is_ok() {
            return Err(format!("{}: a symlink to nothing (not followed to make an image)", image.display()));
        }
        let full = canonical(image);
        if full.starts_with("/dev") {
            return Err(format!("{}: no such device (an image is not made under /dev)", image.display()));
        }
        // Claimed with O_EXCL: another mount making the same image at once (the
        // default one) finds it there and does not format over it, nor remove it.
        // Owner-only: the image holds every file, whatever their modes say.
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&full) {
            Ok(f) => {
                use std::os::unix::fs::MetadataExt;
                let m = f.metadata().map_err(|e| format!("{}: {e}", full.display()))?;
                made = Some(Made { path: full.clone(), dev: m.dev(), ino: m.ino() });
                let sb = pwfs::mkfs_image(&full, a.size, &MkfsOptions::default()).map_err(|e| e.to_string())?;
                out += &format!("created {} ({} MiB)\n", full.display(), (sb.total_blocks * 4096) >> 20);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("{}: {e}", full.display())),
        }
    }
    // A pwfs mount there already: a live one is refused, a dead one (its serving
    // process killed) named, instead of "File exists" or a mount stacked on it.
    if let Some(m) = pwfs_fuse::top_mount(&canonical(mountpoint)).filter(|m| m.fs_type == pwfs_fuse::FS_TYPE) {
        let alive = crate::control::ask(&socket_file(mountpoint), "pid").is_ok();
        return Err(if alive {
            format!("{}: a pwfs file system ({}) is mounted there already", mountpoint.display(), m.source)
        } else {
            format!(
                "{}: a pwfs mount whose serving process is gone is still there (`pwfs umount {}` removes it)",
                mountpoint.display(),
                mountpoint.display()
            )
        });
    }
    std::fs::create_dir_all(mountpoint).map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    // Named before the mount, while the mount point resolves without us.
    let (stats_path, sock_path) = (stats_file(mountpoint), socket_file(mountpoint));
    let result_path = result_file(mountpoint);
    // A result left by an earlier mount here is not this one's.
    let _ = std::fs::remove_file(&result_path);
    let check_on_mount = if o.check { pwfs::MountCheck::Always } else { pwfs::MountCheck::IfNotClean };
    let atime = o.atime.unwrap_or(false);
    let config = Config {
        cache_bytes: o.cache.unwrap_or(DEFAULT_CACHE),
        fetch: o.fetch.unwrap_or(pwfs::FetchPolicy::AsyncBackground),
        stack: o.stack.unwrap_or_default(),
        poll: o.poll.unwrap_or(false),
        hitchhike: o.hitchhike.unwrap_or(true),
        check_on_mount,
        atime,
        ..Default::default()
    };
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
    // The shim needs the kernel to take file sizes from the engine, which its write-back
    // cache does not (it keeps its own): no shim in that mode.
    let write_back = o.kernel_cache == Some(pwfs_fuse::KernelCache::WriteBack);
    let shim_on = o.shim.unwrap_or(true) && !write_back;
    if write_back && o.shim == Some(true) {
        out += "pwfs: warning: no shim with --kernel-cache write-back (the kernel keeps its own file sizes)\n";
    }
    // The source in /proc/mounts: the image, by its full path, unless fsname= says.
    let source = o
        .fsname
        .clone()
        .unwrap_or_else(|| image.canonicalize().unwrap_or_else(|_| image.clone()).to_string_lossy().into_owned());
    let options = pwfs_fuse::MountOptions {
        allow_other: o.allow_other,
        kernel_cache: o.kernel_cache.unwrap_or_default(),
        dev_fuse_only: o.fuse_uring == Some(false),
        fsname: Some(source),
        suid: o.suid,
        dev: o.dev,
        threads: o.threads,
        shim: shim_on,
        // The mount says what the engine does: noatime unless access times are on, then
        // relatime (strictatime is kept as asked, and served by the relatime rule).
        flags: if atime {
            (o.flags & !libc::MS_NOATIME) | if o.flags & libc::MS_STRICTATIME == 0 { libc::MS_RELATIME } else { 0 }
        } else {
            o.flags | libc::MS_NOATIME
        },
    };
    // The shim's socket, like the control socket, before the mount appears: a program
    // started as soon as the mount is there finds it (its registrations wait for the
    // mount's device below).
    if shim_on {
        match pwfs_shim::server::Server::start(shim_file(mountpoint), fs.clone()) {
            Ok(server) => *SHIM.lock().unwrap_or_else(|e| e.into_inner()) = Some(server),
            Err(e) => out += &format!("pwfs: warning: no shim socket, LD_PRELOAD clients use the mount ({e})\n"),
        }
    }
    let mounted = pwfs_fuse::mount_with(fs.clone(), mountpoint, &options)
        .inspect(|_| {
            if let Some(m) = made.take() {
                std::mem::forget(m);
            }
        })
        .map_err(|e| format!("mount at {}: {e}", mountpoint.display()))?;
    let unmounter = mounted.unmounter();
    if let Some(server) = SHIM.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        let view = mounted.view();
        match std::fs::metadata(mountpoint) {
            Ok(m) => server.attach(m.dev(), mountpoint, Box::new(move |ino| view.changed(ino))),
            Err(e) => out += &format!("pwfs: warning: the shim cannot serve: {}: {e}\n", mountpoint.display()),
        }
    }
    out += &format!(
        "pwfs: {} mounted at {}; Ctrl-C, SIGTERM or `pwfs umount {}` unmounts\n",
        image.display(),
        mountpoint.display(),
        mountpoint.display()
    );
    // The serving threads register their ring entries right after the mount returns.
    if o.fuse_uring != Some(false) && pwfs_fuse::uring_offered() {
        let start = std::time::Instant::now();
        while mounted.ring_entries() == 0 && start.elapsed() < std::time::Duration::from_millis(100) {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        if mounted.ring_entries() > 0 {
            out +=
                &format!("pwfs: requests come through FUSE over io_uring ({} ring entries)\n", mounted.ring_entries());
        }
    }
    match report.take() {
        Some(mut p) => {
            let _ = write!(p, "ok{out}");
            // Detach stdin and stdout from the terminal (stderr is the log already).
            // SAFETY: dup2 of a descriptor this process holds onto its stdio.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                for fd in 0..2 {
                    libc::dup2(null, fd);
                }
            }
        }
        None => {
            let mut o = std::io::stdout();
            let _ = o.write_all(out.as_bytes()).and_then(|_| o.flush());
        }
    }
    // Live counters for `pwfs stat` without the socket, rewritten every second until
    // the unmount (then removed, and not written again).
    let (fs2, path2) = (fs.clone(), stats_path.clone());
    let stats_stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stats_stop.clone();
    let stats_thread = std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(dir) = path2.parent() {
                if runtime_dir(dir).is_ok() {
                    let _ = write_runtime(&path2, render_stats(&fs2).as_bytes());
                }
            }
            std::thread::park_timeout(std::time::Duration::from_secs(1));
        }
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
            // Only our own mount: if someone unmounted it already, what is mounted there
            // now (or what was under it) is not ours to remove.
            // Whatever becomes of the unmount (busy, moved away, detached with files
            // open), what was written so far is made durable first.
            Ok(Event::Signal) => {
                if let Err(e) = fs.sync() {
                    say(format_args!("pwfs: sync on a signal failed: {e}\n"));
                }
                match unmounter.unmount() {
                    Ok(true) => {}
                    Ok(false) => say(format_args!(
                        "pwfs: {} is no longer this daemon's mount (moved or unmounted); not unmounting it\n",
                        mountpoint.display()
                    )),
                    Err(e) => say(format_args!(
                        "pwfs: cannot unmount {}: {e}; retrying when the next signal arrives\n",
                        mountpoint.display()
                    )),
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
    SHIM.lock().unwrap_or_else(|e| e.into_inner()).take();
    stats_stop.store(true, std::sync::atomic::Ordering::Release);
    stats_thread.thread().unpark();
    let _ = stats_thread.join();
    let _ = std::fs::remove_file(&stats_path);
    // Flushed even when serving ended with an error: what was acknowledged is written.
    let down = fs.is_down();
    let flushed = fs.unmount().map_err(|e| format!("flushing {} at unmount: {e}", image.display()));
    let result = served.map_err(|e| format!("serving {}: {e}", mountpoint.display())).and(flushed);
    // For `pwfs umount`, which is not this process's parent and cannot see its exit
    // status: written before the exit it waits for.
    let _ = write_runtime(
        &result_path,
        match &result {
            Ok(()) => "ok\n".to_string(),
            Err(e) => format!("failed: {e}\n"),
        }
        .as_bytes(),
    );
    result?;
    if down {
        say(format_args!(
            "pwfs: {} unmounted after a shutdown; the image is as a power cut left it\n",
            mountpoint.display()
        ));
    } else {
        say(format_args!("pwfs: {} unmounted; data flushed, journal empty\n", mountpoint.display()));
    }
    Ok(ExitCode::SUCCESS)
}

/// An image made by this mount, removed when dropped (the mount failed) if its path
/// still names that file.
struct Made {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for Made {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A message of a serving process on stderr. A terminal hung up or a pipe closed (EIO,
/// EPIPE) must not end it: `eprintln!` panics then, and a daemon that panics leaves a
/// dead mount and its last changes unwritten.
fn say(args: std::fmt::Arguments<'_>) {
    let _ = std::io::stderr().write_fmt(args);
}

/// Bytes of file data Patchwork caches by default.
pub const DEFAULT_CACHE: u64 = 256 << 20;

/// The flags of the pwfs mount at `mountpoint` (for a remount: options not named stay).
pub fn current_flags(mountpoint: &Path) -> Result<MountOpts, String> {
    let canon = mountpoint.canonicalize().map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    let m = pwfs_fuse::top_mount(&canon)
        .filter(|m| m.fs_type == pwfs_fuse::FS_TYPE)
        .ok_or_else(|| format!("{}: no pwfs mounted there", mountpoint.display()))?;
    // The per-mount options name nosuid and nodev when they apply.
    let mut o = MountOpts { suid: true, dev: true, ..Default::default() };
    crate::helper::parse_options(&m.options, true, &mut o)?;
    Ok(o)
}

/// Remount the pwfs mount at `mountpoint` with `o`'s flags (read-only or back, suid,
/// noexec, the atime options...). The kernel changes the superblock and the mount; the
/// serving process sees it and tells the engine. Going read-only, it also makes
/// everything durable before returning (`pwfs sync`).
pub fn remount(mountpoint: &Path, o: &MountOpts) -> Result<(), String> {
    let canon = mountpoint.canonicalize().map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    let mut flags = libc::MS_REMOUNT | o.flags;
    if !o.suid {
        flags |= libc::MS_NOSUID;
    }
    if !o.dev {
        flags |= libc::MS_NODEV;
    }
    let c = CString::new(canon.as_os_str().as_bytes()).map_err(|_| "mount point contains NUL".to_string())?;
    let read_only = o.flags & libc::MS_RDONLY != 0;
    // To rw: the engine takes writes before the kernel lets any through, so none
    // written back in between meets a read-only engine.
    if !read_only {
        crate::control::set_read_only(mountpoint, false)?;
    }
    // SAFETY: a valid C string; no source, type or data for a remount.
    let r = unsafe { libc::mount(std::ptr::null(), c.as_ptr(), std::ptr::null(), flags, std::ptr::null()) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if !read_only && current_flags(mountpoint).is_ok_and(|f| f.flags & libc::MS_RDONLY != 0) {
            // Still read-only in the kernel: so is the engine again.
            let _ = crate::control::set_read_only(mountpoint, true);
        }
        return Err(format!("remount of {}: {e}", mountpoint.display()));
    }
    // To ro: the kernel refuses writes from here; the engine commits, checkpoints and
    // marks the image clean before this returns (the watcher would do it a little later).
    if read_only {
        crate::control::set_read_only(mountpoint, true)?;
    }
    Ok(())
}

/// `pwfs umount`: unmount a FUSE mount point (root: umount2; otherwise fusermount3
/// -u), then wait for its serving process to flush and exit (up to a minute), so that
/// the image is clean and free when this returns.
pub fn umount(mountpoint: &Path) -> Result<(), String> {
    // Only a pwfs mount (a dead one too, whose path no longer resolves: ENOTCONN), as
    // umount(8) with a type: another file system at that path is not ours to take down.
    let at = canonical(mountpoint);
    match pwfs_fuse::top_mount(&at) {
        None => return Err(format!("{}: not mounted", mountpoint.display())),
        Some(m) if m.fs_type != pwfs_fuse::FS_TYPE => {
            return Err(format!("{}: not a pwfs mount ({} is mounted there)", mountpoint.display(), m.fs_type))
        }
        Some(_) => {}
    }
    // Asked before the unmount: the serving process answers until it flushes.
    let pid = crate::control::ask(&socket_file(mountpoint), "pid").ok().and_then(|r| r.trim().parse::<i32>().ok());
    let (result_path, log) = (result_file(mountpoint), log_file(mountpoint));
    // The path checked above, not followed again (a symlink changed in between would
    // have this unmount another file system; fusermount3 does the same).
    let c = CString::new(at.as_os_str().as_bytes()).map_err(|_| "mount point contains NUL".to_string())?;
    // SAFETY: plain syscall with a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), libc::UMOUNT_NOFOLLOW) } != 0 {
        let e = std::io::Error::last_os_error();
        let fallback = e.raw_os_error() == Some(libc::EPERM)
            && std::process::Command::new("fusermount3").arg("-u").arg(mountpoint).status().is_ok_and(|s| s.success());
        if !fallback {
            return Err(format!("cannot unmount {}: {e}", mountpoint.display()));
        }
    }
    if let Some(pid) = pid {
        let t = std::time::Instant::now();
        while process_alive(pid) {
            if t.elapsed() > std::time::Duration::from_secs(60) {
                return Err(format!(
                    "{} unmounted, but its serving process {pid} has not finished flushing after a minute",
                    mountpoint.display()
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Its own account of the flush: a failure is this command's too (exit non-zero),
        // as umount(8) fails when the file system cannot be written out.
        let result = std::fs::read_to_string(&result_path);
        let _ = std::fs::remove_file(&result_path);
        return match result {
            Ok(r) if r.trim() == "ok" => Ok(()),
            Ok(r) => Err(format!(
                "{} unmounted, but {} (log: {})",
                mountpoint.display(),
                r.trim().trim_start_matches("failed: "),
                log.display()
            )),
            // Killed, or a build from before the result file: not known to have failed.
            Err(_) => {
                eprintln!(
                    "pwfs: {} unmounted; its serving process {pid} left no account of its last flush (log: {})",
                    mountpoint.display(),
                    log.display()
                );
                Ok(())
            }
        };
    }
    Ok(())
}

/// Whether process `pid` exists and has not exited (a zombie has).
fn process_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S ...`: the state follows the last ')'.
        Ok(s) => s.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Where serving processes keep their live counters and control sockets.
pub const RUN_DIR: &str = "/run/pwfs";

/// A directory for runtime files (sockets, logs, counters), made 0755 if missing, and
/// refused if another user owns it or others may write in it: a symlink planted there
/// would have the daemon write, as root, wherever it points.
pub(crate) fn runtime_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new().mode(0o755).recursive(true).create(dir)?;
    let m = std::fs::symlink_metadata(dir)?;
    // SAFETY: plain syscall.
    let euid = unsafe { libc::geteuid() };
    if !m.is_dir() || m.uid() != euid || m.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{}: not a directory of this user's that only it may write in", dir.display()),
        ));
    }
    Ok(())
}

/// Write a runtime file whole (readable by all, written by its owner), never through a
/// symlink.
fn write_runtime(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(data)
}

/// The full path of a mount point, also of a mount whose serving process was killed
/// (it does not resolve, ENOTCONN; its parent does).
fn canonical(mountpoint: &Path) -> PathBuf {
    mountpoint.canonicalize().unwrap_or_else(|_| {
        let parent = mountpoint.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        match (parent.canonicalize(), mountpoint.file_name()) {
            (Ok(p), Some(name)) => p.join(name),
            _ => mountpoint.to_path_buf(),
        }
    })
}

/// `RUN_DIR/<mount point, '/' as '-' (see `runtime_name`)>.EXT`
/// (`pwfs_shim::proto::runtime_name`: /mnt/pwfs is `mnt-pwfs`).
fn runtime_file(mountpoint: &Path, ext: &str) -> PathBuf {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let canon = canonical(mountpoint);
    let mut name = pwfs_shim::proto::runtime_name(canon.as_os_str().as_bytes());
    name.push(b'.');
    name.extend_from_slice(ext.as_bytes());
    Path::new(RUN_DIR).join(std::ffi::OsString::from_vec(name))
}

/// How the serving process of `mountpoint` ended ("ok", or "failed: why"), written as
/// it exits.
fn result_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "result")
}

/// Where the serving process of `mountpoint` keeps its live counters.
fn stats_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "stats")
}

/// The log of a daemon serving `mountpoint` (its stderr), kept after it exits.
pub fn log_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "log")
}

/// The control socket of the serving process of `mountpoint` (see `control`).
pub fn socket_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "sock")
}

/// The shim's socket of `mountpoint` (the name `pwfs_shim::proto::socket_path` gives).
fn shim_file(mountpoint: &Path) -> PathBuf {
    runtime_file(mountpoint, "shim")
}

/// The shim server of this process's mount, while it serves.
static SHIM: std::sync::Mutex<Option<pwfs_shim::server::Server>> = std::sync::Mutex::new(None);

/// The mount point a file in RUN_DIR is named after.
pub fn mountpoint_of(file: &Path) -> PathBuf {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let stem = file.file_stem().unwrap_or_default();
    PathBuf::from(std::ffi::OsString::from_vec(pwfs_shim::proto::runtime_unescape(stem.as_bytes())))
}

pub fn render_stats(fs: &pwfs::Fs) -> String {
    let state = match fs.poisoned() {
        Some(why) if fs.is_down() => why.replace('\n', " "),
        Some(why) => format!("read-only after an error: {}", why.replace('\n', " ")),
        None if fs.is_read_only() => "read-only".to_string(),
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
    let h = fs.hitchhike_stats();
    let d = fs.device_counters();
    let per_sync = |n: u64| if h.sync_commits == 0 { 0.0 } else { n as f64 / h.sync_commits as f64 };
    let hitchhike = if h.active {
        format!(
            "hitchhike             on (buffer of {} blocks)\n\
             sync pages seen       {}\n\
             hitchhiked            {} ({:.1}%), in the commit block\n\
             metadata as deltas    {}\n\
             data logged whole     {}\n\
             bytes saved           {}\n\
             commits of a commit block alone {} (fsync commits {})\n\
             device writes per fsync commit {:.2} (flushes {:.2}, FUA writes {:.2}; all writes counted)\n\
             blocks buffered now   {} (written home after idling: {})\n",
            h.capacity,
            h.sync_pages,
            h.hitchhiked,
            if h.sync_pages == 0 { 0.0 } else { 100.0 * h.hitchhiked as f64 / h.sync_pages as f64 },
            h.meta_deltas,
            h.data_images,
            h.bytes_saved,
            h.commit_only,
            h.sync_commits,
            per_sync(d.writes),
            per_sync(d.flushes),
            per_sync(d.fua_writes),
            h.buffered,
            h.retired,
        )
    } else if fs.config().hitchhike {
        "hitchhike             off (read-only, a version-1 image, or a journal too small)\n".to_string()
    } else {
        "hitchhike             off\n".to_string()
    };
    format!(
        "state                 {state}\n\
         commit interval       {interval}\n\
         fetch policy          {:?}\n\
         I/O stack             {:?}{}\n\
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
         cache dropped behind  {}\n\
         journal commits       {}\n\
         journal checkpoints   {}\n",
        fs.config().fetch,
        fs.config().stack,
        if fs.config().poll { ", hybrid polling" } else { "" },
        n.patches_created,
        n.patches_merged,
        n.fetches_avoided,
        n.fetches_deferred,
        n.reads_from_patches,
        n.patch_memory_fallbacks,
        n.partial_write_fetches,
        n.patch_bytes,
        fs.cache_dropped_behind(),
        j.commits,
        j.checkpoints,
    ) + &hitchhike
        + &shim_stats()
}

fn shim_stats() -> String {
    match SHIM.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| s.counters()) {
        Some(c) => format!(
            "shim processes        {} now, {} in all\n\
             shim threads          {}\n\
             shim files registered {}\n\
             shim requests         {}\n",
            c.sessions, c.sessions_total, c.channels, c.registered, c.requests
        ),
        None => "shim                  off\n".to_string(),
    }
}

/// The counters the serving process of `mountpoint` last wrote.
pub fn stat_file(mountpoint: &Path) -> Result<String, String> {
    let p = stats_file(mountpoint);
    std::fs::read_to_string(&p)
        .map_err(|e| format!("{}: no pwfs mounted there ({}: {e})", mountpoint.display(), p.display()))
}
