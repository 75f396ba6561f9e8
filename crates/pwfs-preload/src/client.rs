//! The client side of the shim: which descriptors are on a Patchwork mount, the
//! process's session with each mount's daemon, the calling thread's channel, and one
//! request over it.
//!
//! Shared state is small and mostly lock-free: a table of descriptors (one atomic word
//! each), the mounts found so far, and one spin lock (`LOCK`) for what talks on a
//! session socket (registering a descriptor, opening a channel, finding mounts). A
//! fork bumps `FORK_GEN` in the child: descriptors, sessions and channels of an older
//! generation are the parent's and are made again on first use.

use crate::real;
use pwfs_shim::proto::{self, Header, Kind, Msg, Op, Stat, CLOSED, DATA, DONE, HEADER, MAP_LEN, REQUEST};
use std::cell::{Cell, RefCell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// The longest the calling thread spins for its answer before it sleeps; it spins
/// only while the channel's recent answers came quickly (`Chan::spin_ns`).
const CLIENT_SPIN_NS: u64 = 30_000;
/// Answers slower than this on average (a read from the device, a commit) are slept
/// for at once: on a machine with few CPUs a spinning client takes the CPU the daemon
/// needs to answer (db_bench fillsync through the shim: 246 µs an op sleeping at once,
/// 330 µs spinning 30 µs first).
const SLOW_NS: u64 = 15_000;
/// How long it sleeps at a time before it looks whether the daemon is still there.
const LIVENESS_MS: u64 = 100;
/// Descriptors the table covers; higher ones go to the kernel.
const MAX_FDS: usize = 1 << 16;
/// Mounts the shim keeps track of.
const MAX_MOUNTS: usize = 16;

/// The fork generation of this process (bumped in a child).
pub static FORK_GEN: AtomicU32 = AtomicU32::new(0);

/// Why a call was not carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fail {
    /// Let the kernel do it (not ours, no daemon, a call the shim does not carry).
    Kernel,
    /// Fail the call with this errno.
    Errno(i32),
}

pub type R<T> = Result<T, Fail>;

// ---- the spin lock -------------------------------------------------------------

/// A spin lock that a fork can reset: `std`'s mutexes cannot be unlocked in the child
/// of a fork taken while another thread held them.
pub struct Lock<T> {
    held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through `with`, which holds the lock.
unsafe impl<T: Send> Sync for Lock<T> {}

impl<T> Lock<T> {
    pub const fn new(v: T) -> Lock<T> {
        Lock { held: AtomicBool::new(false), value: UnsafeCell::new(v) }
    }

    pub fn raw_lock(&self) {
        while self.held.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::thread::yield_now();
        }
    }

    /// # Safety
    /// The caller holds the lock (or is the only thread left: the child of a fork).
    pub unsafe fn raw_unlock(&self) {
        self.held.store(false, Ordering::Release);
    }

    pub fn with<U>(&self, f: impl FnOnce(&mut T) -> U) -> U {
        self.raw_lock();
        struct Unlock<'a>(&'a AtomicBool);
        impl Drop for Unlock<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _u = Unlock(&self.held);
        // SAFETY: the lock is held until _u drops.
        f(unsafe { &mut *self.value.get() })
    }
}

/// The process's sessions and mounts, under the lock.
pub struct State {
    /// st_dev of the Patchwork mounts found, with their socket paths.
    mounts: Vec<(u64, Vec<u8>)>,
    /// Devices known not to be Patchwork mounts (a cache, cleared when full).
    others: Vec<u64>,
}

pub static LOCK: Lock<State> = Lock::new(State { mounts: Vec::new(), others: Vec::new() });

/// Per mount (index into `State::mounts`), readable without the lock: its device,
/// the session socket (-1: none), the generation it was made in, and whether the
/// daemon is known gone.
static DEVS: [AtomicU64; MAX_MOUNTS] = [const { AtomicU64::new(0) }; MAX_MOUNTS];
static SOCKS: [AtomicI32; MAX_MOUNTS] = [const { AtomicI32::new(-1) }; MAX_MOUNTS];
static SOCK_GEN: [AtomicU32; MAX_MOUNTS] = [const { AtomicU32::new(0) }; MAX_MOUNTS];
static GONE: [AtomicBool; MAX_MOUNTS] = [const { AtomicBool::new(false) }; MAX_MOUNTS];

// ---- the descriptor table ----------------------------------------------------

/// An entry is OURS [| PRIVATE] [| APPEND] | generation << 40 | mount << 32 | handle,
/// or one of the other states with a fresh number (`fresh`) in its low 32 bits:
/// UNKNOWN (not looked at yet), NOT_OURS, CHANGING, OPENED_HERE | generation << 40
/// (opened by this process, not registered yet). The number makes every change of an
/// entry a new word, so that a registration that looked at the descriptor before a
/// close or dup2 (and then saw UNKNOWN again) cannot install the old file under it.
static FDS: [AtomicU64; MAX_FDS] = [const { AtomicU64::new(0) }; MAX_FDS];
const OURS: u64 = 1 << 63;
/// Not a regular file of a Patchwork mount with a shim.
const NOT_OURS: u64 = 1 << 58;
/// Being closed or replaced (close, dup2 onto it, F_SETFL): until the kernel call is
/// done, calls on it go to the kernel and nothing registers it (`begin_change`).
const CHANGING: u64 = 1 << 59;
/// With NOT_OURS: a Patchwork file the shim stopped carrying (`stop_carrying`), which a
/// vfork child must not make UNKNOWN again (`tracked`).
const STOPPED: u64 = 1 << 57;
const STATES: u64 = OURS | NOT_OURS | CHANGING | OPENED_HERE;
static SEQ: AtomicU32 = AtomicU32::new(1);

/// A number no recent entry has.
fn fresh() -> u64 {
    SEQ.fetch_add(1, Ordering::Relaxed) as u64
}

fn unknown() -> u64 {
    fresh()
}
/// The open file description is this descriptor's alone: opened by this process
/// through the open family, and not dup'ed, inherited over a fork or an exec since.
/// Only then does the shim move its file position itself (under `POS_LOCKS`); a shared
/// one's positioned reads and writes go to the kernel, which serialises them.
const PRIVATE: u64 = 1 << 62;
/// Opened with O_APPEND: a write goes to the end whatever the position.
const APPEND: u64 = 1 << 61;
const OPENED_HERE: u64 = 1 << 60;
/// One past the highest descriptor the table has an entry for (bounds the scans).
static HIGH_FD: AtomicUsize = AtomicUsize::new(0);
/// Serialise the positioned calls of one private descriptor among this process's threads.
static POS_LOCKS: [AtomicBool; MAX_FDS] = [const { AtomicBool::new(false) }; MAX_FDS];

fn gen_bits() -> u64 {
    (FORK_GEN.load(Ordering::Relaxed) as u64 & 0xffff) << 40
}

fn entry(mount: usize, handle: u32, private: bool, append: bool) -> u64 {
    let flags = if private { PRIVATE } else { 0 } | if append { APPEND } else { 0 };
    OURS | flags | gen_bits() | ((mount as u64) << 32) | handle as u64
}

fn slot(fd: i32) -> Option<&'static AtomicU64> {
    FDS.get(usize::try_from(fd).ok()?)
}

/// A carried descriptor: its mount and handle, whether its description is private
/// to it and whether it appends.
#[derive(Debug, Clone, Copy)]
pub struct Ours {
    pub mount: usize,
    pub handle: u32,
    pub private: bool,
    pub append: bool,
}

fn decode(e: u64) -> Option<Ours> {
    (e & OURS != 0 && e & (0xffff << 40) == gen_bits()).then_some(Ours {
        mount: ((e >> 32) & 0xff) as usize,
        handle: e as u32,
        private: e & PRIVATE != 0,
        append: e & APPEND != 0,
    })
}

fn note_high(fd: usize) {
    HIGH_FD.fetch_max(fd + 1, Ordering::Relaxed);
}

/// `fd` was just opened by this process (the open family): its description is its own.
pub fn opened(fd: i32) {
    if let Some(s) = slot(fd) {
        note_high(fd as usize);
        release(s.swap(OPENED_HERE | gen_bits() | fresh(), Ordering::AcqRel));
    }
}

/// The handle of an entry that was carried goes back to the daemon.
fn release(e: u64) {
    if let Some(o) = decode(e) {
        release_handle(o);
    }
}

pub fn release_handle(o: Ours) {
    let _ = request(o, Op::Release, 0, 0, 0, |_| 0, |_, _, _| ());
}

/// `fd`'s description is now shared (dup'ed; about to be inherited): its position is
/// the kernel's to move from now on.
pub fn shared(fd: i32) {
    if let Some(s) = slot(fd) {
        let _ = s.fetch_update(Ordering::AcqRel, Ordering::Acquire, |e| {
            (e & (PRIVATE | OPENED_HERE) != 0).then_some(if e & OURS != 0 { e & !PRIVATE } else { unknown() })
        });
    }
}

/// Every description is shared from now on (a fork, a spawn, an exec).
pub fn all_shared() {
    let high = HIGH_FD.load(Ordering::Relaxed).min(MAX_FDS);
    for fd in 0..high {
        shared(fd as i32);
    }
}

/// Hold the position lock of a private descriptor while `f` runs.
pub fn with_position<T>(fd: i32, f: impl FnOnce() -> T) -> T {
    let l = &POS_LOCKS[fd as usize];
    while l.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        std::thread::yield_now();
    }
    struct Unlock<'a>(&'a AtomicBool);
    impl Drop for Unlock<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    let _u = Unlock(l);
    f()
}

/// Forget what the table says of `fd` (a new descriptor took its number): its handle
/// (if this generation registered it) is released in the daemon.
pub fn forget(fd: i32) {
    let Some(s) = slot(fd) else { return };
    if let Some(was) = replace_unless_changing(s, unknown) {
        release(was);
    }
}

/// Put `new()` in the entry unless a close or replacement of the number is under way
/// (`begin_change`): that one's `end_change` must find its token there, or the entry
/// would stay as it was before the kernel call. Returns what was replaced.
fn replace_unless_changing(s: &AtomicU64, new: impl Fn() -> u64) -> Option<u64> {
    let mut cur = s.load(Ordering::Acquire);
    loop {
        if cur & CHANGING != 0 {
            return None;
        }
        match s.compare_exchange_weak(cur, new(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(was) => return Some(was),
            Err(now) => cur = now,
        }
    }
}

/// `fd` is about to be closed or replaced by a kernel call: until `end_change`,
/// nothing registers it. Returns the token for `end_change` and what was carried.
pub fn begin_change(fd: i32) -> (u64, Option<Ours>) {
    let Some(s) = slot(fd) else { return (0, None) };
    // Within the scans (a fork child clears what a parent thread was changing).
    note_high(fd as usize);
    let token = CHANGING | fresh();
    (token, decode(s.swap(token, Ordering::AcqRel)))
}

/// The kernel call after `begin_change` is done: the number is for the next
/// look to classify (unless an open took it meanwhile and said so).
pub fn end_change(fd: i32, token: u64) {
    if let Some(s) = slot(fd) {
        let _ = s.compare_exchange(token, unknown(), Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// close(2) of a descriptor that was `o`, before the kernel's: if it was carried, the daemon reports a
/// write lost after it returned and releases the handle: Some(errno) then (0: nothing
/// lost). `end_change` follows the kernel's close.
pub fn close(o: Option<Ours>) -> Option<i32> {
    match request(o?, Op::Close, 0, 0, 0, |_| 0, |_, _, _| ()) {
        Err(Fail::Errno(e)) => Some(e),
        _ => Some(0),
    }
}

/// Carry nothing more of `fd` (a shared writable mapping of it: the kernel's pages are
/// written back behind the shim's writes, so all its I/O goes through the kernel).
pub fn stop_carrying(fd: i32) {
    if let Some(was) = slot(fd).and_then(|s| replace_unless_changing(s, || NOT_OURS | STOPPED | fresh())) {
        release(was);
    }
}

/// Whether `fd` is known not to be a Patchwork file (a socket or pipe the shim has
/// looked at): its flags need no watching.
pub fn known_not_ours(fd: i32) -> bool {
    slot(fd).is_some_and(|s| s.load(Ordering::Relaxed) & NOT_OURS != 0)
}

/// Forget every carried descriptor whose description may be shared (its O_APPEND was
/// changed through another descriptor of it: registered again with the new flags).
pub fn forget_shared() {
    let high = HIGH_FD.load(Ordering::Relaxed).min(MAX_FDS);
    for (fd, e) in FDS.iter().enumerate().take(high) {
        if decode(e.load(Ordering::Acquire)).is_some_and(|o| !o.private) {
            forget(fd as i32);
        }
    }
}

/// Every descriptor from `first` to `last` is about to be closed (close_range,
/// closefrom): `begin_change` of each the table knows (their handles released); the
/// tokens, for `end_range`, once the kernel call is done.
pub fn begin_range(first: u32, last: u32) -> Vec<(i32, u64)> {
    let last = (last as usize).min(MAX_FDS - 1);
    let mut tokens = Vec::new();
    for (fd, e) in FDS.iter().enumerate().take(last + 1).skip(first as usize) {
        if e.load(Ordering::Relaxed) & STATES != 0 {
            let (token, was) = begin_change(fd as i32);
            if let Some(o) = was {
                release_handle(o);
            }
            tokens.push((fd as i32, token));
        }
    }
    tokens
}

pub fn end_range(tokens: &[(i32, u64)]) {
    for &(fd, token) in tokens {
        end_change(fd, token);
    }
}

pub fn fstat_raw(fd: i32) -> Option<libc::stat64> {
    // SAFETY: fstat into a zeroed buffer, through the real function.
    unsafe {
        let mut st: libc::stat64 = std::mem::zeroed();
        (real::fstat64(fd, &mut st) == 0).then_some(st)
    }
}

/// Whether `fd` is carried, registering it with its mount's daemon on first sight.
pub fn classify(fd: i32) -> Option<Ours> {
    let s = slot(fd)?;
    let e = s.load(Ordering::Acquire);
    if e & (NOT_OURS | CHANGING) != 0 {
        return None;
    }
    if let Some(o) = decode(e) {
        return (!GONE[o.mount].load(Ordering::Relaxed)).then_some(o);
    }
    let private = e & OPENED_HERE != 0 && e & (0xffff << 40) == gen_bits();
    let st = fstat_raw(fd)?;
    let found = if st.st_mode & libc::S_IFMT == libc::S_IFREG { mount_of(st.st_dev) } else { None };
    let Some(mount) = found else {
        let _ = s.compare_exchange(e, NOT_OURS | fresh(), Ordering::AcqRel, Ordering::Relaxed);
        return None;
    };
    let (handle, append) = match LOCK.with(|st| register(st, mount, fd)) {
        Ok(h) => h,
        Err(_) => {
            let _ = s.compare_exchange(e, NOT_OURS | fresh(), Ordering::AcqRel, Ordering::Relaxed);
            return None;
        }
    };
    let o = Ours { mount, handle, private, append };
    note_high(fd as usize);
    let new = entry(mount, handle, private, append);
    if s.compare_exchange(e, new, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // Another thread got there first, or the descriptor was closed or replaced
        // meanwhile (its entry is a new word even if UNKNOWN again).
        let _ = request(o, Op::Release, 0, 0, 0, |_| 0, |_, _, _| ());
        return decode(s.load(Ordering::Acquire));
    }
    Some(o)
}

/// The mount a descriptor of device `dev` is on, if it is a Patchwork mount with a
/// shim socket. Used for syncfs(2) of any descriptor, too.
pub fn mount_of(dev: u64) -> Option<usize> {
    if let Some(i) = DEVS.iter().position(|d| d.load(Ordering::Relaxed) == dev && dev != 0) {
        return (!GONE[i].load(Ordering::Relaxed)).then_some(i);
    }
    LOCK.with(|st| {
        if let Some(i) = st.mounts.iter().position(|m| m.0 == dev) {
            return (!GONE[i].load(Ordering::Relaxed)).then_some(i);
        }
        if st.others.contains(&dev) {
            return None;
        }
        scan_mounts(st);
        match st.mounts.iter().position(|m| m.0 == dev) {
            Some(i) => Some(i),
            None => {
                if st.others.len() >= 64 {
                    st.others.clear();
                }
                st.others.push(dev);
                None
            }
        }
    })
}

/// Every Patchwork mount known (after looking at mountinfo again).
pub fn all_mounts() -> Vec<usize> {
    LOCK.with(|st| {
        scan_mounts(st);
        (0..st.mounts.len()).filter(|i| !GONE[*i].load(Ordering::Relaxed)).collect()
    })
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
pub fn unescape(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\' && s.len() - i > 3 {
            let o = &s[i + 1..i + 4];
            if o.iter().all(|c| (b'0'..=b'7').contains(c)) {
                out.push((o[0] - b'0') * 64 + (o[1] - b'0') * 8 + (o[2] - b'0'));
                i += 4;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// Add the `fuse.pwfs` mounts of /proc/self/mountinfo not known yet.
fn scan_mounts(st: &mut State) {
    let Ok(info) = std::fs::read("/proc/self/mountinfo") else { return };
    for line in info.split(|c| *c == b'\n') {
        let fields: Vec<&[u8]> = line.split(|c| *c == b' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == b"-") else { continue };
        if fields.get(dash + 1) != Some(&&b"fuse.pwfs"[..]) || fields.len() < 5 {
            continue;
        }
        let Some((maj, min)) = std::str::from_utf8(fields[2]).ok().and_then(|d| d.split_once(':')) else { continue };
        let (Ok(maj), Ok(min)) = (maj.parse::<u32>(), min.parse::<u32>()) else { continue };
        let dev = libc::makedev(maj, min);
        if st.mounts.iter().any(|m| m.0 == dev) || st.mounts.len() >= MAX_MOUNTS {
            continue;
        }
        let path = proto::socket_path(&unescape(fields[4]));
        DEVS[st.mounts.len()].store(dev, Ordering::Relaxed);
        st.mounts.push((dev, path));
    }
}

// ---- sessions --------------------------------------------------------------

/// The session socket of mount `m` in this generation, connecting (and saying hello)
/// if there is none. Called with the lock held.
fn session(st: &State, m: usize) -> R<i32> {
    let gen = FORK_GEN.load(Ordering::Relaxed);
    let sock = SOCKS[m].load(Ordering::Relaxed);
    if sock >= 0 && SOCK_GEN[m].load(Ordering::Relaxed) == gen {
        return Ok(sock);
    }
    if sock >= 0 {
        // An older generation's (the fork handler closes those): not ours to use.
        SOCKS[m].store(-1, Ordering::Relaxed);
    }
    if GONE[m].load(Ordering::Relaxed) {
        return Err(Fail::Kernel);
    }
    let path = &st.mounts.get(m).ok_or(Fail::Kernel)?.1;
    let sock = connect(path).ok_or_else(|| {
        // No socket: the daemon serves no shim (or is gone). Not again.
        GONE[m].store(true, Ordering::Relaxed);
        Fail::Kernel
    })?;
    let hello = proto::send(sock, &Msg::new(Kind::Hello, proto::VERSION), -1) == 0
        && matches!(proto::recv(sock), Ok((r, -1)) if r.status == 0);
    if !hello {
        // SAFETY: our own socket.
        unsafe { real::close(sock) };
        GONE[m].store(true, Ordering::Relaxed);
        return Err(Fail::Kernel);
    }
    SOCKS[m].store(sock, Ordering::Relaxed);
    SOCK_GEN[m].store(gen, Ordering::Relaxed);
    Ok(sock)
}

/// Whether `fd` is one of the shim's own session sockets (which the program's close,
/// close_range, closefrom, dup2 and dup3 must not take away).
pub fn is_session_socket(fd: i32) -> bool {
    fd >= 0 && SOCKS.iter().any(|s| s.load(Ordering::Relaxed) == fd)
}

/// The shim's session sockets now.
pub fn session_sockets() -> Vec<i32> {
    SOCKS.iter().map(|s| s.load(Ordering::Relaxed)).filter(|s| *s >= 0).collect()
}

/// Move a session socket off `fd` (the program wants that number): Ok if it was not
/// one, or was moved.
pub fn free_number(fd: i32) {
    for s in &SOCKS {
        if s.load(Ordering::Relaxed) == fd {
            // SAFETY: fcntl/close of our own socket.
            unsafe {
                let moved = real::fcntl64(fd, libc::F_DUPFD_CLOEXEC, high_number() as libc::c_long);
                s.store(moved, Ordering::Relaxed);
                real::close(fd);
            }
        }
    }
}

/// Where the shim puts its sockets: high, out of the way of programs that expect the
/// lowest free numbers.
fn high_number() -> i32 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit into a local.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    ((lim.rlim_cur as i64 / 2).clamp(64, 1 << 15)) as i32
}

/// In the child of a fork: the parent's session sockets are the parent's; close them
/// at once, before the program can open anything under their numbers.
pub fn close_inherited_sockets() {
    for s in &SOCKS {
        let fd = s.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: closing the child's copy of an inherited socket.
            unsafe { real::close(fd) };
        }
    }
}

fn connect(path: &[u8]) -> Option<i32> {
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if path.len() >= addr.sun_path.len() {
        return None;
    }
    for (d, s) in addr.sun_path.iter_mut().zip(path) {
        *d = *s as libc::c_char;
    }
    // SAFETY: socket/connect with a valid address; the descriptor is closed on failure.
    unsafe {
        let sock = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return None;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        if libc::connect(sock, &addr as *const _ as *const libc::sockaddr, len) != 0 {
            real::close(sock);
            return None;
        }
        let high = real::fcntl64(sock, libc::F_DUPFD_CLOEXEC, high_number() as libc::c_long);
        if high >= 0 {
            real::close(sock);
            return Some(high);
        }
        Some(sock)
    }
}

/// One exchange on mount `m`'s session socket. Called with the lock held. A broken
/// socket means the daemon is gone.
fn ask(st: &State, m: usize, msg: Msg, fd: i32) -> R<(Msg, i32)> {
    let sock = session(st, m)?;
    let r = if proto::send(sock, &msg, fd) == 0 { proto::recv(sock).ok() } else { None };
    match r {
        Some(r) => Ok(r),
        None => {
            GONE[m].store(true, Ordering::Relaxed);
            Err(Fail::Kernel)
        }
    }
}

/// Register `fd` with mount `m`'s daemon: its handle, and whether it appends.
fn register(st: &State, m: usize, fd: i32) -> R<(u32, bool)> {
    let (r, extra) = ask(st, m, Msg::new(Kind::Register, 0), fd)?;
    if extra >= 0 {
        // SAFETY: an unexpected descriptor received just now.
        unsafe { real::close(extra) };
    }
    if r.status != 0 {
        return Err(Fail::Errno(r.status as i32));
    }
    Ok((r.a as u32, r.b & proto::REGISTERED_APPEND != 0))
}

// ---- channels --------------------------------------------------------------

/// A thread's channel to one mount's daemon.
struct Chan {
    map: *mut u8,
    gen: u32,
    /// Moving average of the daemon's time per answer on this channel (ns).
    recent_ns: Cell<u64>,
}

impl Chan {
    fn open(m: usize) -> R<Chan> {
        let (r, memfd) = LOCK.with(|st| ask(st, m, Msg::new(Kind::Channel, 0), -1))?;
        if r.status != 0 || memfd < 0 {
            if memfd >= 0 {
                // SAFETY: a descriptor received just now.
                unsafe { real::close(memfd) };
            }
            return Err(Fail::Kernel);
        }
        // SAFETY: mapping the memfd the daemon sized to MAP_LEN; closed right after
        // (the mapping stays).
        let map = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                MAP_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd,
                0,
            );
            real::close(memfd);
            p
        };
        if map == libc::MAP_FAILED {
            return Err(Fail::Kernel);
        }
        Ok(Chan { map: map as *mut u8, gen: FORK_GEN.load(Ordering::Relaxed), recent_ns: Cell::new(0) })
    }

    /// How long to spin for the answer to `op`: never for a commit, else about twice
    /// what recent answers took, unless they were slow.
    fn spin_ns(&self, op: Op) -> u64 {
        let recent = self.recent_ns.get();
        if matches!(op, Op::Fsync | Op::Syncfs) || recent > SLOW_NS {
            0
        } else {
            (2 * recent + 3_000).min(CLIENT_SPIN_NS)
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with the channel's Header and lives as long as self.
        unsafe { &*(self.map as *const Header) }
    }

    #[allow(clippy::mut_from_ref)]
    fn data(&self) -> &mut [u8] {
        // SAFETY: the data area follows the header inside the mapping; only this thread
        // touches it while it owns the slot.
        unsafe { std::slice::from_raw_parts_mut(self.map.add(HEADER), DATA) }
    }
}

impl Drop for Chan {
    fn drop(&mut self) {
        // A channel of an older generation is the parent's: leave it open for it.
        if self.gen == FORK_GEN.load(Ordering::Relaxed) {
            let h = self.header();
            h.state.store(CLOSED, Ordering::SeqCst);
            proto::futex_wake(&h.state);
        }
        // SAFETY: the mapping was made by Chan::open with MAP_LEN bytes.
        unsafe { libc::munmap(self.map as *mut libc::c_void, MAP_LEN) };
    }
}

thread_local! {
    static CHANS: RefCell<[Option<Chan>; MAX_MOUNTS]> = const { RefCell::new([const { None }; MAX_MOUNTS]) };
    /// The thread is inside the shim: a call from a signal handler goes to the kernel.
    static BUSY: Cell<bool> = const { Cell::new(false) };
    /// The shim set the program's errno during this call.
    static ERRNO_SET: Cell<bool> = const { Cell::new(false) };
}

extern "C" {
    fn pthread_setcancelstate(state: libc::c_int, old: *mut libc::c_int) -> libc::c_int;
}

/// glibc's value (PTHREAD_CANCEL_ENABLE is 0).
const PTHREAD_CANCEL_DISABLE: libc::c_int = 1;

/// Run `f` as the shim, unless the thread already is (then None: the kernel does it).
/// A panic inside also ends in None.
pub fn shim<T>(f: impl FnOnce() -> Option<T>) -> Option<T> {
    let entered = BUSY.try_with(|b| !b.replace(true)).unwrap_or(false);
    if !entered {
        return None;
    }
    // What the shim's own calls leave in errno (a futex timeout, a failed connect) is
    // not the program's: only `set_errno` changes what it sees.
    // SAFETY: the thread's errno location.
    let saved = unsafe { *libc::__errno_location() };
    let _ = ERRNO_SET.try_with(|e| e.set(false));
    // The shim's own poll, sendmsg, recvmsg, connect and close are cancellation
    // points: a pthread_cancel acted on there would unwind through Rust frames (and
    // `catch_unwind` aborts on that foreign unwind). Deferred until the call is done,
    // as for a call that never blocked.
    let mut cancel = 0;
    // SAFETY: glibc's pthread_setcancelstate with a valid out pointer.
    unsafe { pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &mut cancel) };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok().flatten();
    // SAFETY: as above, restoring the state the program had.
    unsafe { pthread_setcancelstate(cancel, std::ptr::null_mut()) };
    if !ERRNO_SET.try_with(|e| e.get()).unwrap_or(false) {
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = saved };
    }
    let _ = BUSY.try_with(|b| b.set(false));
    r
}

/// Set the program's errno from inside the shim.
pub fn set_errno(e: i32) {
    // SAFETY: the thread's errno location.
    unsafe { *libc::__errno_location() = e };
    let _ = ERRNO_SET.try_with(|f| f.set(true));
}

/// Whether the daemon of mount `m` hung up.
fn hung_up(m: usize) -> bool {
    let sock = SOCKS[m].load(Ordering::Relaxed);
    if sock < 0 {
        return true;
    }
    let mut p = libc::pollfd { fd: sock, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
    // SAFETY: poll of one descriptor, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// Counters of this process's requests (for tests: whether calls were carried).
pub static REQUESTS: AtomicUsize = AtomicUsize::new(0);

/// One request on the calling thread's channel to `o.mount`: `fill` writes the
/// request's data into the data area and returns its length; `take` gets the data
/// area and the answer. Ok((result, r1)); Err(Kernel) if it never reached the daemon.
pub fn request(
    o: Ours,
    op: Op,
    a: u64,
    b: u64,
    c: u64,
    fill: impl FnOnce(&mut [u8]) -> usize,
    take: impl FnOnce(&Header, &[u8], usize),
) -> R<(i64, u64)> {
    CHANS
        .try_with(|chans| {
            let mut chans = chans.try_borrow_mut().map_err(|_| Fail::Kernel)?;
            let gen = FORK_GEN.load(Ordering::Relaxed);
            let slot = chans.get_mut(o.mount).ok_or(Fail::Kernel)?;
            if slot.as_ref().is_some_and(|c| c.gen != gen || c.header().state.load(Ordering::Relaxed) == CLOSED) {
                *slot = None;
            }
            if slot.is_none() {
                *slot = Some(Chan::open(o.mount)?);
            }
            let ch = slot.as_ref().expect("just opened");
            let r = exchange(ch, o, op, (a, b, c), fill, take);
            if r == Err(Fail::Errno(libc::EIO)) && ch.header().state.load(Ordering::Relaxed) == CLOSED {
                *slot = None;
            }
            r
        })
        .unwrap_or(Err(Fail::Kernel))
}

fn exchange(
    ch: &Chan,
    o: Ours,
    op: Op,
    (a, b, c): (u64, u64, u64),
    fill: impl FnOnce(&mut [u8]) -> usize,
    take: impl FnOnce(&Header, &[u8], usize),
) -> R<(i64, u64)> {
    let h = ch.header();
    let len = fill(ch.data());
    h.op.store(op as u32, Ordering::Relaxed);
    h.handle.store(o.handle as u64, Ordering::Relaxed);
    h.a.store(a, Ordering::Relaxed);
    h.b.store(if len > 0 { len as u64 } else { b }, Ordering::Relaxed);
    h.c.store(c, Ordering::Relaxed);
    if h.state.compare_exchange(DONE, REQUEST, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        // Closed by the daemon (it is going): nothing was asked.
        return Err(Fail::Kernel);
    }
    REQUESTS.fetch_add(1, Ordering::Relaxed);
    if h.server_waits.load(Ordering::SeqCst) != 0 {
        proto::futex_wake(&h.state);
    }
    let start = proto::now_ns();
    let spin = ch.spin_ns(op);
    loop {
        match h.state.load(Ordering::Acquire) {
            DONE => break,
            CLOSED => return Err(Fail::Errno(libc::EIO)),
            _ => {}
        }
        if proto::now_ns() - start < spin {
            std::hint::spin_loop();
            continue;
        }
        h.client_waits.store(1, Ordering::SeqCst);
        if h.state.load(Ordering::SeqCst) == REQUEST {
            proto::futex_wait(&h.state, REQUEST, LIVENESS_MS);
        }
        h.client_waits.store(0, Ordering::SeqCst);
        if h.state.load(Ordering::SeqCst) == REQUEST && hung_up(o.mount) {
            // The daemon is gone with the request: whether it happened is unknown.
            GONE[o.mount].store(true, Ordering::Relaxed);
            return Err(Fail::Errno(libc::EIO));
        }
    }
    if !matches!(op, Op::Fsync | Op::Syncfs) {
        // The daemon's own time for it (what it left in `c`), not this thread's wait,
        // which a sleep would make look slow for good.
        let took = h.c.load(Ordering::Relaxed).min(1_000_000);
        ch.recent_ns.set((ch.recent_ns.get() * 7 + took) / 8);
    }
    let result = h.result.load(Ordering::Relaxed);
    let r1 = h.r1.load(Ordering::Relaxed);
    if result < 0 {
        return Err(Fail::Errno(i32::try_from(-result).unwrap_or(libc::EIO)));
    }
    take(h, ch.data(), usize::try_from(result).unwrap_or(0).min(DATA));
    Ok((result, r1))
}

/// The attributes of a carried descriptor.
pub fn stat(o: Ours) -> R<Stat> {
    let mut st = Stat::default();
    request(o, Op::Stat, 0, 0, 0, |_| 0, |h, _, _| st = h.stat())?;
    Ok(st)
}

/// st_dev of mount `m`'s files.
pub fn dev_of(m: usize) -> u64 {
    DEVS[m].load(Ordering::Relaxed)
}

/// A request on mount `m` with no handle (syncfs).
pub fn mount_request(m: usize, op: Op) -> R<()> {
    request(Ours { mount: m, handle: u32::MAX, private: false, append: false }, op, 0, 0, 0, |_| 0, |_, _, _| ())
        .map(|_| ())
}

/// The process the table belongs to (0 before `note_owner`).
static OWNER: AtomicI32 = AtomicI32::new(0);

/// This process owns the table (at load, and in a forked child).
pub fn note_owner() {
    // SAFETY: getpid has no arguments (the system call: glibc caches nothing).
    OWNER.store(unsafe { libc::syscall(libc::SYS_getpid) } as i32, Ordering::Relaxed);
}

/// Whether the caller is a child of `vfork` (or `clone(CLONE_VM)`) running in its
/// parent's memory, before its exec: the table is the parent's, but the descriptor
/// table the kernel changes is the child's own. Its close, dup2, close_range and opens
/// must not touch the table or release the parent's handles. (A system call: asked
/// only of calls on numbers the table tracks, and of rare calls.)
pub fn in_vfork_child() -> bool {
    let owner = OWNER.load(Ordering::Relaxed);
    // SAFETY: as above.
    owner != 0 && unsafe { libc::syscall(libc::SYS_getpid) } as i32 != owner
}

/// Whether the table tracks `fd` as a Patchwork file (carried, opened here, or no
/// longer carried because of a shared writable mapping: a vfork child's close or dup2
/// onto it must not make the parent carry it again).
fn tracked(fd: i32) -> bool {
    slot(fd).is_some_and(|s| s.load(Ordering::Relaxed) & (OURS | OPENED_HERE | STOPPED) != 0)
}

/// A change of `fd` the table must not follow: the table tracks the number, and the
/// caller is a vfork child (whose descriptor table is not the one the table is of).
pub fn vfork_childs(fd: i32) -> bool {
    tracked(fd) && in_vfork_child()
}

/// After a fork, in the child: a new generation; the lock may have been held by a
/// thread that does not exist here.
pub fn after_fork_in_child() {
    note_owner();
    FORK_GEN.fetch_add(1, Ordering::SeqCst);
    close_inherited_sockets();
    // SAFETY: the child has one thread; whoever held the lock is not in it.
    unsafe { LOCK.raw_unlock() };
    // Position locks held by threads of the parent: their calls do not go on here (a
    // descriptor number the child reuses would wait on them for ever).
    let high = HIGH_FD.load(Ordering::Relaxed).min(MAX_FDS);
    for l in &POS_LOCKS[..high] {
        l.store(false, Ordering::Release);
    }
    // Entries a parent thread was closing or replacing: that thread is not here to end
    // the change; the child has the old file or no descriptor, and looks again.
    for e in &FDS[..high] {
        if e.load(Ordering::Relaxed) & CHANGING != 0 {
            e.store(unknown(), Ordering::Release);
        }
    }
}
