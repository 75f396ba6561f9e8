//! The daemon side of the shim: a socket per mount, a thread per client process (its
//! session) and a thread per client thread (its channel), serving the engine directly.
//!
//! A client proves its right to a file by passing its open descriptor; the daemon
//! reads the access mode from it, opens the inode in the engine (so its number is not
//! reused while the handle lives) and drops the descriptor. What a client changes the
//! kernel did not see: [`Server::attach`]'s `changed` is told the inode after every
//! change, so that the FUSE front end drops what the kernel caches of it.

use crate::proto::{self, Header, Kind, Msg, Op, Stat, CLOSED, DATA, DONE, HEADER, MAP_LEN, REQUEST};
use parking_lot::{Mutex, RwLock};
use pwfs::{Fs, Metadata, PrivChange};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// How long a channel's thread spins for the next request after answering one, before
/// it sleeps: long enough to cover a program's own work between two calls.
const SPIN_NS: u64 = 50_000;
/// How often a sleeping channel thread looks whether its session is over.
const IDLE_CHECK_MS: u64 = 500;
/// Limits of what one client process, and all of them, may hold: each channel is a
/// thread and 1 MiB of shared memory in this process.
const MAX_CHANNELS: usize = 1024;
const MAX_HANDLES: usize = 1 << 16;
const MAX_SESSIONS: usize = 4096;
/// The socket is open to every user (the kernel checks each one's access to the files
/// it registers): no user but root may hold more than this many sessions, and all
/// clients together no more channels (threads) than `MAX_ALL_CHANNELS`.
const MAX_SESSIONS_PER_USER: usize = 512;
const MAX_ALL_CHANNELS: u64 = 4096;

/// Tells the front end that an inode changed behind the kernel's back.
pub type Changed = Box<dyn Fn(u64) + Send + Sync>;

/// Counters of a server (`pwfs stat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Client processes connected now, and ever.
    pub sessions: u64,
    pub sessions_total: u64,
    /// Channels (client threads) open now.
    pub channels: u64,
    /// Descriptors registered, ever.
    pub registered: u64,
    /// Requests answered.
    pub requests: u64,
}

impl Shared {
    /// The mount, once attached (waiting up to 10 s for it).
    fn mount(&self) -> Option<&(u64, Changed)> {
        if let Some(m) = self.mount.get() {
            return Some(m);
        }
        let (lock, cv) = &self.attached;
        let g = lock.lock().unwrap_or_else(|e| e.into_inner());
        let _ = cv.wait_timeout_while(g, std::time::Duration::from_secs(10), |a| !*a);
        self.mount.get()
    }

    fn changed(&self, ino: u64) {
        if let Some((_, changed)) = self.mount.get() {
            changed(ino);
        }
    }
}

struct Shared {
    fs: Fs,
    /// The mount: st_dev of its files, and what to tell of a change (set by `attach`
    /// once the mount is up; registrations wait for it).
    mount: std::sync::OnceLock<(u64, Changed)>,
    /// The mount's unique id (statx STATX_MNT_ID_UNIQUE, Linux 6.8+; None before):
    /// once the mount is gone, its device number can go to another FUSE mount, which
    /// anyone may make, before this server stops.
    mount_id: std::sync::OnceLock<Option<u64>>,
    attached: (std::sync::Mutex<bool>, std::sync::Condvar),
    closing: AtomicBool,
    sessions: Mutex<Vec<Weak<Session>>>,
    /// Channel threads spinning now, and how many may.
    spinners: AtomicUsize,
    max_spinners: usize,
    sessions_total: AtomicU64,
    channels: AtomicU64,
    registered: AtomicU64,
    requests: AtomicU64,
}

/// A client process.
struct Session {
    sock: OwnedFd,
    /// Its user when it connected (SO_PEERCRED).
    uid: Option<u32>,
    /// The client may keep set-ID bits when it writes (CAP_FSETID).
    fsetid: bool,
    /// The client's groups (its own and supplementary, when it connected): whether a
    /// write of its clears an S_ISGID that has no group execute.
    groups: Vec<u32>,
    handles: RwLock<Slab>,
    channels: Mutex<Vec<Arc<Channel>>>,
    dead: AtomicBool,
}

/// Registered descriptors of a session. A handle's id is its slot and the slot's
/// generation (`slot | generation << 16`): a slot freed and taken again answers to
/// a new id, so that a request still in flight with the old one (another thread of
/// the client closed or replaced the descriptor meanwhile) gets EBADF, not another
/// file.
#[derive(Default)]
struct Slab {
    slots: Vec<(u32, Option<Arc<Handle>>)>,
    /// Freed slots, taken oldest first: a slot's generation wraps only after 32,768
    /// reuses of that slot, not of the last one freed.
    free: std::collections::VecDeque<usize>,
}

/// Generations wrap at 15 bits: ids stay below 2^31 (u32::MAX means no handle).
const GENERATIONS: u32 = 1 << 15;

impl Slab {
    fn insert(&mut self, h: Handle) -> usize {
        let h = Some(Arc::new(h));
        let i = match self.free.pop_front() {
            Some(i) => {
                self.slots[i].1 = h;
                i
            }
            None => {
                self.slots.push((0, h));
                self.slots.len() - 1
            }
        };
        debug_assert!(i < MAX_HANDLES);
        i | (self.slots[i].0 as usize) << 16
    }

    /// The slot of a handle id, if its generation is the slot's.
    fn slot(&self, id: u64) -> Option<usize> {
        let i = usize::try_from(id & 0xffff).ok()?;
        (id >> 16 == self.slots.get(i)?.0 as u64).then_some(i)
    }

    fn get(&self, id: u64) -> Option<Arc<Handle>> {
        self.slots[self.slot(id)?].1.clone()
    }

    fn remove(&mut self, id: u64) -> Option<Arc<Handle>> {
        let i = self.slot(id)?;
        let slot = &mut self.slots[i];
        let h = slot.1.take()?;
        slot.0 = (slot.0 + 1) % GENERATIONS;
        self.free.push_back(i);
        Some(h)
    }

    fn live(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

/// A registered descriptor.
struct Handle {
    file: pwfs::File,
    /// `WRITE_SYNC` / `WRITE_DATASYNC` from its O_SYNC / O_DSYNC.
    sync: u64,
}

/// A channel's shared mapping.
struct Channel {
    map: *mut u8,
}

// SAFETY: the mapping is shared memory used only through atomics (the header) and by
// the one thread serving the channel (the data area).
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl Channel {
    fn new() -> std::io::Result<(Channel, OwnedFd)> {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"pwfs-shim".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate, fcntl and mmap of our memfd; results checked. Sealed at its
        // size: a client that could shrink it would make this process fault (SIGBUS)
        // on its next look at the header.
        let map = unsafe {
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::ftruncate(fd.as_raw_fd(), MAP_LEN as libc::off_t) != 0
                || libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            libc::mmap(
                std::ptr::null_mut(),
                MAP_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok((Channel { map: map as *mut u8 }, fd))
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a zeroed (= DONE, no request) Header, lives as
        // long as self, and is only accessed through its atomics.
        unsafe { &*(self.map as *const Header) }
    }

    /// The data area, `len` (≤ DATA) bytes. The client does not touch it while the
    /// channel holds a request (a client that does only garbles its own data).
    #[allow(clippy::mut_from_ref)]
    fn data(&self, len: usize) -> &mut [u8] {
        // SAFETY: HEADER + len ≤ MAP_LEN, inside the mapping; only this channel's
        // thread uses the data area while the request is in progress.
        unsafe { std::slice::from_raw_parts_mut(self.map.add(HEADER), len.min(DATA)) }
    }

    fn close(&self) {
        let h = self.header();
        h.state.store(CLOSED, Ordering::SeqCst);
        proto::futex_wake(&h.state);
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by Channel::new with MAP_LEN bytes.
        unsafe { libc::munmap(self.map as *mut libc::c_void, MAP_LEN) };
    }
}

/// A shim socket being served. Dropping it removes the socket, ends every session
/// (the clients' channels close: they fall back to the kernel) and waits for nothing.
pub struct Server {
    shared: Arc<Shared>,
    path: PathBuf,
    id: (u64, u64),
    listener: Arc<OwnedFd>,
}

impl Server {
    /// Serve `fs` at `path` (mode 0666: any
    /// user may connect; only a descriptor the kernel let it open gets it a handle).
    /// The socket exists from here on, before the mount appears, so that a program
    /// started as soon as the mount is there finds it; registrations wait (up to 10 s)
    /// for [`Server::attach`].
    pub fn start(path: PathBuf, fs: Fs) -> std::io::Result<Server> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        // SAFETY: socket(2); the result is checked.
        let sock = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
        if sock < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let sock = unsafe { OwnedFd::from_raw_fd(sock) };
        let (addr, len) = sockaddr(&path)?;
        // SAFETY: bind/listen/chmod on our socket with a valid address.
        unsafe {
            if libc::bind(sock.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) != 0
                || libc::listen(sock.as_raw_fd(), 128) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))?;
        let m = std::fs::symlink_metadata(&path)?;
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        let shared = Arc::new(Shared {
            fs,
            mount: std::sync::OnceLock::new(),
            mount_id: std::sync::OnceLock::new(),
            attached: (std::sync::Mutex::new(false), std::sync::Condvar::new()),
            closing: AtomicBool::new(false),
            sessions: Mutex::new(Vec::new()),
            spinners: AtomicUsize::new(0),
            // Leave a CPU to the clients.
            max_spinners: std::env::var("PWFS_SHIM_SPINNERS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or((cpus / 2).max(1)),
            sessions_total: AtomicU64::new(0),
            channels: AtomicU64::new(0),
            registered: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        });
        let listener = Arc::new(sock);
        let (s2, l2) = (shared.clone(), listener.clone());
        std::thread::Builder::new().name("pwfs-shim".into()).spawn(move || accept_loop(&s2, &l2))?;
        Ok(Server { shared, path, id: (m.dev(), m.ino()), listener })
    }

    /// The mount is up: its files have st_dev `dev`, its root is `root` (for its
    /// kernel mount id, see `register`), and `changed` drops what the kernel caches of
    /// an inode.
    pub fn attach(&self, dev: u64, root: &std::path::Path, changed: Changed) {
        let _ = self.shared.mount_id.set(unique_mount_id(root, None));
        let _ = self.shared.mount.set((dev, changed));
        let (lock, cv) = &self.shared.attached;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }

    pub fn counters(&self) -> Counters {
        let s = &self.shared;
        let live = s.sessions.lock().iter().filter(|w| w.strong_count() > 0).count();
        Counters {
            sessions: live as u64,
            sessions_total: s.sessions_total.load(Ordering::Relaxed),
            channels: s.channels.load(Ordering::Relaxed),
            registered: s.registered.load(Ordering::Relaxed),
            requests: s.requests.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
        // SAFETY: shutdown of our listening socket wakes the accepting thread.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for s in self.shared.sessions.lock().drain(..).filter_map(|w| w.upgrade()) {
            // Wakes the session's thread, which closes its channels.
            // SAFETY: shutdown of a socket the session owns.
            unsafe { libc::shutdown(s.sock.as_raw_fd(), libc::SHUT_RDWR) };
            s.dead.store(true, Ordering::SeqCst);
            for ch in s.channels.lock().iter() {
                ch.close();
            }
        }
        // A request being answered finishes before the engine is unmounted after this:
        // wait (bounded) for every channel's thread to end.
        let t = std::time::Instant::now();
        while self.shared.channels.load(Ordering::SeqCst) > 0 && t.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

fn sockaddr(path: &Path) -> std::io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket path too long"));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Ok((addr, std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t))
}

fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    loop {
        // SAFETY: accept4 on our listening socket; the result is checked.
        let fd = unsafe {
            libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
        };
        if shared.closing.load(Ordering::SeqCst) {
            if fd >= 0 {
                // SAFETY: a descriptor accept just gave us.
                unsafe { libc::close(fd) };
            }
            return;
        }
        if fd < 0 {
            // Out of descriptors or the like: let it pass.
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        // SAFETY: a fresh descriptor we own.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        if shared.sessions.lock().iter().filter(|w| w.strong_count() > 0).count() >= MAX_SESSIONS {
            // Refused: the client's hello fails and it uses the kernel.
            continue;
        }
        let shared = shared.clone();
        let _ = std::thread::Builder::new().name("pwfs-shim-session".into()).spawn(move || session(shared, sock));
    }
}

/// capability(7) number of CAP_FSETID.
const CAP_FSETID: u32 = 4;

/// Whether process `pid` has CAP_FSETID in its effective set, and its file-system
/// group with its supplementary groups, from one read of /proc/PID/status (none when
/// it cannot be read).
fn fsetid_and_groups(pid: i32) -> (bool, Vec<u32>) {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return (false, Vec::new()) };
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).unwrap_or("");
    let caps = u64::from_str_radix(field("CapEff:").trim(), 16).unwrap_or(0);
    // Gid: real, effective, saved, file system.
    let fsgid = field("Gid:").split_whitespace().nth(3).and_then(|g| g.parse().ok());
    let groups = fsgid.into_iter().chain(field("Groups:").split_whitespace().filter_map(|g| g.parse().ok()));
    (caps & (1 << CAP_FSETID) != 0, groups.collect())
}

/// The peer's process and its effective user at connect (SO_PEERCRED).
fn peer(sock: &OwnedFd) -> Option<(i32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a ucred of the right size.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0).then_some((cred.pid, cred.uid))
}

/// Whether process `pid` is in this process's user namespace (a capability in another
/// one, `unshare -r`'s root, is no capability over this file system).
fn same_userns(pid: i32) -> bool {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/user")).ok();
    matches!((ns(&pid.to_string()), ns("self")), (Some(a), Some(b)) if a == b)
}

fn session(shared: Arc<Shared>, sock: OwnedFd) {
    // CAP_FSETID is read from /proc after the connect: the peer may have exec'd a
    // set-user-ID program since (a child holding the socket). Only a peer that was
    // root when it connected is believed, as the kernel's check at the write would
    // find it (a non-root holder of the capability gets set-ID bits cleared).
    let peer = peer(&sock);
    let (fsetid, groups) = match peer {
        Some((pid, uid)) => {
            let (fsetid, groups) = fsetid_and_groups(pid);
            (fsetid && uid == 0 && same_userns(pid), groups)
        }
        None => (false, Vec::new()),
    };
    let uid = peer.map(|p| p.1);
    if uid != Some(0) {
        let theirs = shared.sessions.lock().iter().filter_map(|w| w.upgrade()).filter(|s| s.uid == uid).count();
        if theirs >= MAX_SESSIONS_PER_USER {
            // Refused: the client's hello fails and it uses the kernel.
            return;
        }
    }
    let s = Arc::new(Session {
        sock,
        uid,
        fsetid,
        groups,
        handles: RwLock::new(Slab::default()),
        channels: Mutex::new(Vec::new()),
        dead: AtomicBool::new(false),
    });
    {
        let mut all = shared.sessions.lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&s));
    }
    shared.sessions_total.fetch_add(1, Ordering::Relaxed);
    let fd = s.sock.as_raw_fd();
    let mut hello = false;
    while !shared.closing.load(Ordering::SeqCst) {
        let Ok((m, passed)) = proto::recv(fd) else { break };
        // SAFETY: a descriptor received just now, ours to close.
        let passed = (passed >= 0).then(|| unsafe { OwnedFd::from_raw_fd(passed) });
        let reply = match (m.kind, hello) {
            (k, false) if k == Kind::Hello as u32 => {
                hello = m.a == proto::VERSION;
                Msg { status: if hello { 0 } else { libc::EPROTO as u32 }, ..m }
            }
            (_, false) => Msg { status: libc::EPROTO as u32, ..m },
            (k, true) if k == Kind::Register as u32 => match passed.as_ref().map(|p| register(&shared, &s, p)) {
                Some(Ok((h, append))) => {
                    Msg { status: 0, a: h, b: if append { proto::REGISTERED_APPEND } else { 0 }, ..m }
                }
                Some(Err(e)) => Msg { status: e as u32, ..m },
                None => Msg { status: libc::EBADF as u32, ..m },
            },
            // A channel is a thread here: within the client's own and everyone's limit.
            (k, true)
                if k == Kind::Channel as u32
                    && (s.channels.lock().len() >= MAX_CHANNELS
                        || shared.channels.load(Ordering::SeqCst) >= MAX_ALL_CHANNELS) =>
            {
                Msg { status: libc::EMFILE as u32, ..m }
            }
            (k, true) if k == Kind::Channel as u32 => match Channel::new() {
                Ok((ch, memfd)) => {
                    let ch = Arc::new(ch);
                    s.channels.lock().push(ch.clone());
                    let (sh, ss, ch2) = (shared.clone(), s.clone(), ch.clone());
                    match std::thread::Builder::new().name("pwfs-shim-chan".into()).spawn(move || serve(&sh, &ss, ch2))
                    {
                        Ok(_) => {
                            if proto::send(fd, &Msg { status: 0, ..m }, memfd.as_raw_fd()) != 0 {
                                break;
                            }
                            continue;
                        }
                        Err(e) => {
                            s.channels.lock().retain(|c| !Arc::ptr_eq(c, &ch));
                            Msg { status: e.raw_os_error().unwrap_or(libc::EAGAIN) as u32, ..m }
                        }
                    }
                }
                Err(e) => Msg { status: e.raw_os_error().unwrap_or(libc::ENOMEM) as u32, ..m },
            },
            _ => Msg { status: libc::EINVAL as u32, ..m },
        };
        if proto::send(fd, &reply, -1) != 0 {
            break;
        }
    }
    // The process is gone (or the server is closing): close its channels, release its
    // handles. A channel's thread answering a request finishes it first.
    s.dead.store(true, Ordering::SeqCst);
    for ch in s.channels.lock().drain(..) {
        ch.close();
    }
    let handles = std::mem::take(&mut *s.handles.write());
    drop(handles);
}

/// The unique id of the mount `path` (or, with `fd`, that descriptor) is on: None
/// where the kernel has none (before 6.8) or the call fails.
pub fn unique_mount_id(path: &std::path::Path, fd: Option<i32>) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let (dirfd, flags) = match fd {
        Some(fd) => (fd, libc::AT_EMPTY_PATH),
        None => (libc::AT_FDCWD, libc::AT_SYMLINK_NOFOLLOW),
    };
    // SAFETY: statx is plain data (zeroed is valid); the call gets a NUL-terminated
    // path and that buffer, which it fills.
    let (r, stx) = unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        (libc::statx(dirfd, c.as_ptr(), flags, libc::STATX_MNT_ID_UNIQUE, &mut stx), stx)
    };
    (r == 0 && stx.stx_mask & libc::STATX_MNT_ID_UNIQUE != 0).then_some(stx.stx_mnt_id)
}

/// Check the descriptor a client passed and open its inode: (handle, whether it appends).
fn register(shared: &Shared, s: &Session, fd: &OwnedFd) -> Result<(u64, bool), i32> {
    // SAFETY: fstat/fcntl of a descriptor we hold, into a zeroed stat buffer.
    let (st, flags) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(libc::EBADF);
        }
        (st, libc::fcntl(fd.as_raw_fd(), libc::F_GETFL))
    };
    let dev = shared.mount().map(|m| m.0).ok_or(libc::EAGAIN)?;
    if st.st_dev != dev || st.st_mode & libc::S_IFMT != libc::S_IFREG || flags < 0 {
        return Err(libc::EXDEV);
    }
    // The same device number on another mount (ours unmounted, the number given to a
    // new one): not ours.
    if let Some(Some(ours)) = shared.mount_id.get() {
        if unique_mount_id(std::path::Path::new(""), Some(fd.as_raw_fd())) != Some(*ours) {
            return Err(libc::EXDEV);
        }
    }
    // An O_PATH descriptor reads and writes nothing.
    if flags & libc::O_PATH != 0 {
        return Err(libc::EBADF);
    }
    let acc = flags & libc::O_ACCMODE;
    let (read, write) = (acc == libc::O_RDONLY || acc == libc::O_RDWR, acc == libc::O_WRONLY || acc == libc::O_RDWR);
    let append = flags & libc::O_APPEND != 0;
    let file = shared.fs.open_ino_file(st.st_ino, read, write, append && write).map_err(|e| e.errno())?;
    // O_SYNC includes the O_DSYNC bit.
    let sync = match (flags & libc::O_SYNC == libc::O_SYNC, flags & libc::O_DSYNC != 0) {
        (true, _) => proto::WRITE_SYNC,
        (false, true) => proto::WRITE_SYNC | proto::WRITE_DATASYNC,
        _ => 0,
    };
    let mut handles = s.handles.write();
    if handles.live() >= MAX_HANDLES {
        return Err(libc::EMFILE);
    }
    let h = handles.insert(Handle { file, sync });
    drop(handles);
    shared.registered.fetch_add(1, Ordering::Relaxed);
    Ok((h as u64, append && write))
}

/// Wait for a request on `ch`: false when the channel or its session is over.
fn wait_request(shared: &Shared, s: &Session, h: &Header) -> bool {
    let start = proto::now_ns();
    let mut spinning = false;
    let ok = loop {
        match h.state.load(Ordering::Acquire) {
            REQUEST => break true,
            DONE => {}
            // CLOSED, or garbage from a client: the channel is over.
            _ => break false,
        }
        if s.dead.load(Ordering::Relaxed) || shared.closing.load(Ordering::Relaxed) {
            break false;
        }
        if !spinning && proto::now_ns() - start < SPIN_NS {
            spinning = shared
                .spinners
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| (n < shared.max_spinners).then_some(n + 1))
                .is_ok();
        }
        if spinning && proto::now_ns() - start < SPIN_NS {
            std::hint::spin_loop();
            continue;
        }
        if spinning {
            shared.spinners.fetch_sub(1, Ordering::AcqRel);
            spinning = false;
        }
        h.server_waits.store(1, Ordering::SeqCst);
        if h.state.load(Ordering::SeqCst) == DONE {
            proto::futex_wait(&h.state, DONE, IDLE_CHECK_MS);
        }
        h.server_waits.store(0, Ordering::SeqCst);
    };
    if spinning {
        shared.spinners.fetch_sub(1, Ordering::AcqRel);
    }
    ok
}

fn serve(shared: &Shared, s: &Session, ch: Arc<Channel>) {
    shared.channels.fetch_add(1, Ordering::SeqCst);
    let h = ch.header();
    while wait_request(shared, s, h) {
        let start = proto::now_ns();
        // A panic while answering (a bug) answers EIO and leaves the channel in
        // service: unwound past here, the client would wait for ever.
        let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(shared, s, &ch)));
        let (result, r1) = match answered {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => (-(e as i64), 0),
            Err(_) => {
                let _ =
                    std::io::Write::write_all(&mut std::io::stderr(), b"pwfs: a shim request panicked; answered EIO\n");
                (-(libc::EIO as i64), 0)
            }
        };
        h.result.store(result, Ordering::Relaxed);
        h.r1.store(r1, Ordering::Relaxed);
        h.c.store(proto::now_ns() - start, Ordering::Relaxed);
        shared.requests.fetch_add(1, Ordering::Relaxed);
        // CLOSED by the session's end stays CLOSED.
        if h.state.compare_exchange(REQUEST, DONE, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            break;
        }
        if h.client_waits.load(Ordering::SeqCst) != 0 {
            proto::futex_wake(&h.state);
        }
    }
    s.channels.lock().retain(|c| !Arc::ptr_eq(c, &ch));
    drop(ch);
    shared.channels.fetch_sub(1, Ordering::SeqCst);
}

fn stat_of(m: &Metadata) -> Stat {
    Stat {
        ino: m.ino,
        mode: m.mode,
        nlink: m.nlink,
        uid: m.uid,
        gid: m.gid,
        rdev: m.rdev,
        blksize: m.blksize,
        size: m.size,
        blocks: m.blocks,
        atime: (m.atime.sec, m.atime.nsec),
        mtime: (m.mtime.sec, m.mtime.nsec),
        ctime: (m.ctime.sec, m.ctime.nsec),
    }
}

/// Before a change through `h`: a writer without CAP_FSETID clears the file's set-ID
/// bits, and any writer its file capabilities, as the kernel does
/// (`file_remove_privs`). Only for a handle open for writing (a read-only one gets
/// EBADF from the change itself, and must not strip anything first).
fn kill_privs(shared: &Shared, s: &Session, h: &Handle, change: PrivChange) -> Result<(), i32> {
    if !h.file.is_writable() {
        return Err(libc::EBADF);
    }
    let ino = h.file.ino();
    let in_group = |gid| s.groups.contains(&gid);
    let setid = (!s.fsetid).then_some(&in_group as &dyn Fn(u32) -> bool);
    let changed = shared.fs.kill_privs(ino, setid, change).map_err(|e| e.errno())?;
    if changed {
        shared.changed(ino);
    }
    Ok(())
}

/// Answer the request in `ch`: (result, r1) or an errno.
fn answer(shared: &Shared, s: &Session, ch: &Channel) -> Result<(i64, u64), i32> {
    let h = ch.header();
    let op = Op::from_u32(h.op.load(Ordering::Relaxed)).ok_or(libc::ENOSYS)?;
    let (a, b, c) = (h.a.load(Ordering::Relaxed), h.b.load(Ordering::Relaxed), h.c.load(Ordering::Relaxed));
    let id = h.handle.load(Ordering::Relaxed);
    let fs = &shared.fs;
    let e = |e: pwfs::Error| e.errno();
    if op == Op::Syncfs {
        return fs.sync().map(|_| (0, 0)).map_err(e);
    }
    if op == Op::Release {
        s.handles.write().remove(id);
        return Ok((0, 0));
    }
    let handle = s.handles.read().get(id).ok_or(libc::EBADF)?;
    let f = &handle.file;
    let ino = f.ino();
    let len = usize::try_from(b).map_err(|_| libc::EINVAL)?;
    if matches!(op, Op::Read | Op::Write) && len > DATA {
        return Err(libc::EINVAL);
    }
    match op {
        Op::Read => f.read_at(ch.data(len), a).map(|n| (n as i64, 0)).map_err(e),
        Op::Write => {
            if len == 0 {
                return Ok((0, a));
            }
            kill_privs(shared, s, &handle, PrivChange::Write)?;
            let r = f.pwrite(ch.data(len), a);
            // A setcap that landed while the data went in is dropped too (the kernel's
            // inode lock orders the two; here the second look does).
            let _ = fs.kill_privs(ino, None, PrivChange::Write);
            shared.changed(ino);
            let (at, n) = r.map_err(e)?;
            let sync = c | handle.sync;
            if sync & proto::WRITE_SYNC != 0 {
                sync_file(f, sync & proto::WRITE_DATASYNC != 0).map_err(e)?;
            }
            Ok((n as i64, at))
        }
        Op::Fsync => sync_file(f, c == 1).map(|_| (0, 0)).map_err(e),
        Op::Stat => {
            h.set_stat(stat_of(&f.metadata().map_err(e)?));
            Ok((0, 0))
        }
        Op::Truncate => {
            if !f.is_writable() {
                return Err(libc::EINVAL);
            }
            kill_privs(shared, s, &handle, PrivChange::Attributes)?;
            let r = f.set_len(a);
            shared.changed(ino);
            r.map(|_| (0, 0)).map_err(e)
        }
        Op::Fallocate => {
            let mode = u32::try_from(c).map_err(|_| libc::EINVAL)?;
            // A call refused keeps the set-ID bits (the kernel checks first).
            if !f.is_writable() {
                return Err(libc::EBADF);
            }
            fs.fallocate_check(ino, mode, a, b).map_err(e)?;
            kill_privs(shared, s, &handle, PrivChange::Write)?;
            let r = f.allocate(mode, a, b);
            shared.changed(ino);
            r.map(|_| (0, 0)).map_err(e)
        }
        Op::Seek => {
            let whence = i32::try_from(c).map_err(|_| libc::EINVAL)?;
            if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
                return Err(libc::EINVAL);
            }
            f.seek_hole_data(a, whence == libc::SEEK_HOLE).map(|at| (0, at)).map_err(e)
        }
        Op::Close => {
            // A lost write is reported to a handle that could have made it.
            let r = if f.is_writable() { f.report_lost_writes() } else { Ok(()) };
            s.handles.write().remove(id);
            r.map(|_| (0, 0)).map_err(e)
        }
        Op::Syncfs | Op::Release => unreachable!("answered above"),
    }
}

/// fsync(2) or fdatasync(2) through the handle, which reports a lost write once to
/// each handle (`File::sync_all`).
fn sync_file(f: &pwfs::File, datasync: bool) -> pwfs::Result<()> {
    match datasync {
        true => f.sync_data(),
        false => f.sync_all(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Descriptors on another mount than the attached one have another unique mount
    /// id (where the kernel has them), whatever their device number.
    #[test]
    fn mounts_are_told_apart_by_their_unique_id() {
        let here = unique_mount_id(std::path::Path::new("/proc/self"), None);
        let Some(proc_id) = here else {
            eprintln!("skipping: no STATX_MNT_ID_UNIQUE on this kernel");
            return;
        };
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(unique_mount_id(std::path::Path::new(""), Some(f.as_raw_fd())), Some(proc_id));
        let dir = std::env::temp_dir();
        let tmp = unique_mount_id(&dir, None).expect("a mount id for the temporary directory");
        assert_ne!(tmp, proc_id, "/proc is a mount of its own");
    }

    #[test]
    fn a_slab_reuses_freed_slots_and_refuses_unknown_ones() {
        let dev = std::sync::Arc::new(pwfs::device::mem::MemDevice::new(16 << 20));
        pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
        let fs = pwfs::Fs::mount(dev, pwfs::Config::default()).unwrap();
        let f = fs.create("a").unwrap();
        let ino = f.ino();
        let mut slab = Slab::default();
        let h = |file| Handle { file, sync: 0 };
        let a = slab.insert(h(f));
        let b = slab.insert(h(fs.open_ino_file(ino, true, false, false).unwrap()));
        assert_ne!(a, b);
        assert!(slab.remove(a as u64).is_some());
        assert!(slab.remove(a as u64).is_none());
        assert!(slab.get(a as u64).is_none() && slab.get(u64::MAX).is_none());
        let c = slab.insert(h(fs.open_ino_file(ino, true, true, false).unwrap()));
        assert_eq!(c & 0xffff, a & 0xffff, "the slot is reused");
        assert_ne!(c, a, "under a new id");
        assert!(slab.get(a as u64).is_none(), "the old id reaches nothing");
        assert!(slab.remove(a as u64).is_none());
        assert!(slab.get(c as u64).is_some());
        assert!(fs.open_ino_file(pwfs::format::ROOT_INO, true, false, false).is_err());
    }
}
