//! The control socket of a serving `pwfs mount`, and its clients `pwfs sync` and
//! `pwfs stat`. The kernel does not forward sync(2)/syncfs(2) to a FUSE server, so a
//! process that wants a mount made durable asks the serving process here: a UNIX
//! stream socket in /run/pwfs (mode 0600), one request line per connection (`sync`,
//! `stat` or `pid`), one answer (`ok`, `error REASON`, or the rendered counters), then close.

use pwfs::Fs;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The serving side. Dropping it removes the socket (if it is still ours) and waits for
/// the requests in progress; requests that arrive later are refused.
pub struct Server {
    path: PathBuf,
    id: (u64, u64),
    fs: Arc<RwLock<Option<Fs>>>,
}

impl Server {
    /// Bind `path` (a stale socket there is replaced) and answer on a thread of its own,
    /// with one thread per connection, so that a slow sync holds up no `stat`. Call it
    /// before starting threads that create files: it sets the umask for a moment.
    pub fn start(path: PathBuf, fs: Fs) -> std::io::Result<Server> {
        if let Some(dir) = path.parent() {
            crate::mount::runtime_dir(dir)?;
        }
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        // SAFETY: umask only changes the process's file creation mask; the socket is
        // created 0600 instead of being open to everyone until a chmod.
        let old = unsafe { libc::umask(0o177) };
        let listener = UnixListener::bind(&path);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let listener = listener?;
        let m = std::fs::symlink_metadata(&path)?;
        let server = Server { path, id: (m.dev(), m.ino()), fs: Arc::new(RwLock::new(Some(fs))) };
        let fs2 = server.fs.clone();
        std::thread::Builder::new().name("pwfs-control".into()).spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(stream) => {
                        let fs = fs2.clone();
                        let _ =
                            std::thread::Builder::new().name("pwfs-request".into()).spawn(move || answer(stream, &fs));
                    }
                    // Out of file descriptors or the like: let it pass.
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        })?;
        Ok(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
        self.fs.write().unwrap_or_else(|e| e.into_inner()).take();
    }
}

fn answer(stream: UnixStream, fs: &RwLock<Option<Fs>>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut line = String::new();
    if BufReader::new((&stream).take(256)).read_line(&mut line).is_err() {
        return;
    }
    // The read lock is held until the answer is ready: dropping the server waits for it.
    let reply = match (fs.read().unwrap_or_else(|e| e.into_inner()).as_ref(), line.trim_end()) {
        (Some(fs), "sync") => match fs.sync() {
            Ok(()) => "ok\n".to_string(),
            Err(e) => format!("error {}\n", e.to_string().replace('\n', " ")),
        },
        (Some(fs), "stat") => crate::mount::render_stats(fs),
        // A remount through the helper tells the engine itself, before a remount to rw
        // and after one to ro, so that neither waits for the mountinfo watcher.
        (Some(fs), req @ ("ro" | "rw")) => match fs.set_read_only(req == "ro") {
            Ok(()) => "ok\n".to_string(),
            Err(e) => format!("error {}\n", e.to_string().replace('\n', " ")),
        },
        (_, "pid") => format!("{}\n", std::process::id()),
        (None, "sync" | "stat" | "ro" | "rw") => "error the file system is being unmounted\n".to_string(),
        (_, other) => format!("error unknown request {other:?} (known: sync, stat, pid, ro, rw)\n"),
    };
    let _ = (&stream).write_all(reply.as_bytes());
}

/// Send one request to the socket at `path` and return the whole answer. NotFound: no
/// socket; ConnectionRefused: a stale socket whose process is gone.
pub fn ask(path: &Path, request: &str) -> std::io::Result<String> {
    let mut s = UnixStream::connect(path)?;
    // A question the serving process answers from memory is not waited for past ten
    // seconds (a stuck or foreign listener must not hang `pwfs umount` or `pwfs stat`);
    // a sync or a change to read-only takes as long as its commit takes.
    let quick = matches!(request, "pid" | "stat");
    s.set_read_timeout(quick.then(|| std::time::Duration::from_secs(10)))?;
    s.write_all(format!("{request}\n").as_bytes())?;
    s.shutdown(std::net::Shutdown::Write)?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    if reply.is_empty() {
        return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "the serving process closed without answering"));
    }
    Ok(reply)
}

/// Turn the engine of the mount at `mountpoint` read-only (commit, checkpoint, marked
/// clean) or writable again, and return once it is.
pub fn set_read_only(mountpoint: &Path, read_only: bool) -> Result<(), String> {
    let sock = crate::mount::socket_file(mountpoint);
    let reply = ask(&sock, if read_only { "ro" } else { "rw" })
        .map_err(|e| format!("{}: cannot reach the serving process ({}: {e})", mountpoint.display(), sock.display()))?;
    match reply.trim_end() {
        "ok" => Ok(()),
        r => Err(format!("{}: {}", mountpoint.display(), r.strip_prefix("error ").unwrap_or(r))),
    }
}

/// syncfs(2) of the mount: the kernel sends what its own cache holds dirty (write-back
/// mode keeps written pages in the kernel) to the daemon first. The kernel sends no
/// FUSE_SYNCFS to this server, so this alone makes nothing durable; the daemon's
/// sync then does.
fn kernel_sync(mountpoint: &Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(mountpoint)
        .map_err(|e| format!("sync of {}: {e}", mountpoint.display()))?;
    // SAFETY: a plain call on a descriptor this function owns.
    if unsafe { libc::syncfs(std::os::unix::io::AsRawFd::as_raw_fd(&dir)) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("sync of {} failed: writing back the kernel's cache: {e}", mountpoint.display()));
    }
    Ok(())
}

/// `pwfs sync MOUNTPOINT`: returns once everything written to the mount is durable.
pub fn sync(mountpoint: &Path) -> Result<(), String> {
    let sock = crate::mount::socket_file(mountpoint);
    let gone = |e: std::io::Error| format!("{}: no pwfs mounted there ({}: {e})", mountpoint.display(), sock.display());
    // Nobody serving it: said so, before the kernel is asked to write back into it.
    match UnixStream::connect(&sock) {
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) => return Err(gone(e)),
        _ => kernel_sync(mountpoint)?,
    }
    let reply = ask(&sock, "sync").map_err(|e| match e.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused => gone(e),
        _ => format!("sync of {} failed: {}: {e}", mountpoint.display(), sock.display()),
    })?;
    sync_reply(mountpoint, &reply)
}

fn sync_reply(mountpoint: &Path, reply: &str) -> Result<(), String> {
    match reply.trim_end() {
        "ok" => Ok(()),
        r => Err(format!("sync of {} failed: {}", mountpoint.display(), r.strip_prefix("error ").unwrap_or(r))),
    }
}

/// `pwfs sync` without a mount point: every mount served on this machine whose socket
/// answers. A stale socket is noted on stderr and skipped.
pub fn sync_all() -> Result<(), String> {
    let mut socks: Vec<PathBuf> = match std::fs::read_dir(crate::mount::RUN_DIR) {
        Ok(dir) => dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "sock"))
            .collect(),
        Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(format!("{}: {e}", crate::mount::RUN_DIR)),
    };
    socks.sort();
    let (mut tried, mut failed) = (0, 0);
    for sock in &socks {
        let mountpoint = crate::mount::mountpoint_of(sock);
        // A socket whose process is gone is skipped before the kernel is asked to write
        // back into a mount nobody serves.
        if let Err(e) = UnixStream::connect(sock) {
            if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) {
                eprintln!(
                    "pwfs: note: skipping {}: its serving process is gone ({}: {e})",
                    mountpoint.display(),
                    sock.display()
                );
                continue;
            }
        }
        let r = kernel_sync(&mountpoint).and_then(|()| match ask(sock, "sync") {
            Ok(reply) => sync_reply(&mountpoint, &reply),
            Err(e) => Err(format!("sync of {} failed: {}: {e}", mountpoint.display(), sock.display())),
        });
        tried += 1;
        if let Err(e) = r {
            eprintln!("pwfs: {e}");
            failed += 1;
        }
    }
    match failed {
        0 => Ok(()),
        n => Err(format!("{n} of {tried} pwfs mounts not synced")),
    }
}

/// `pwfs stat MOUNTPOINT`: live from the serving process, or, when it has no socket,
/// the counters it last wrote.
pub fn stat(mountpoint: &Path) -> Result<String, String> {
    let sock = crate::mount::socket_file(mountpoint);
    match ask(&sock, "stat") {
        Ok(reply) => match reply.strip_prefix("error ") {
            Some(why) => Err(format!("{}: {}", mountpoint.display(), why.trim_end())),
            None => Ok(reply),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => crate::mount::stat_file(mountpoint),
        Err(e) => Err(format!("{}: no pwfs mounted there ({}: {e})", mountpoint.display(), sock.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::{ask, Server};
    use pwfs::device::mem::MemDevice;
    use pwfs::device::sim::{SimConfig, SimDevice};
    use pwfs::{Config, Fs, MkfsOptions};
    use std::io::ErrorKind;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    #[test]
    fn sync_and_stat_over_the_socket_and_a_failed_sync_says_why() {
        let dir = std::env::temp_dir().join(format!("pwfs-control-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("m.sock");
        // A stale socket (its process gone) is replaced.
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        assert_eq!(ask(&sock, "sync").unwrap_err().kind(), ErrorKind::ConnectionRefused);
        let img = MemDevice::new(16 << 20);
        pwfs::mkfs(&img, &MkfsOptions::default()).unwrap();
        let dev = Arc::new(SimDevice::new(img.snapshot(), SimConfig::default()));
        let fs = Fs::mount(dev.clone(), Config { cache_bytes: 4 << 20, ..Default::default() }).unwrap();
        let server = Server::start(sock.clone(), fs.clone()).unwrap();
        assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o600);
        let stat = ask(&sock, "stat").unwrap();
        assert!(stat.starts_with("state                 read-write\ncommit interval       5s\n"), "{stat}");
        fs.write_file("/a", b"durable").unwrap();
        assert_eq!(ask(&sock, "sync").unwrap(), "ok\n");
        assert!(ask(&sock, "bogus").unwrap().starts_with("error unknown request \"bogus\""));
        fs.write_file("/b", b"never durable").unwrap();
        dev.set_config(SimConfig { fail_writes_after: Some(0), ..Default::default() });
        let r = ask(&sock, "sync").unwrap();
        assert!(r.starts_with("error ") && r.ends_with('\n') && r.lines().count() == 1, "{r}");
        let stat = ask(&sock, "stat").unwrap();
        assert!(stat.starts_with("state                 read-only after an error: "), "{stat}");
        drop(server);
        assert_eq!(ask(&sock, "sync").unwrap_err().kind(), ErrorKind::NotFound);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
