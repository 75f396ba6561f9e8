//! The wire between the shim and the daemon. Both sides are built from this module, so
//! they agree on it; [`VERSION`] guards against a shim and a daemon of different builds.
//!
//! **Session.** The shim connects to the mount's socket ([`socket_path`], a
//! `SOCK_SEQPACKET` UNIX socket, one per mount) once per process. Every message is one
//! [`Msg`]; each request gets one answer, in order:
//! - [`Kind::Hello`] (`a` = [`VERSION`]): answered `status` 0, or EPROTO.
//! - [`Kind::Register`], with an open file descriptor attached (`SCM_RIGHTS`): the
//!   daemon checks it is a regular file of this mount, reads its access mode, and
//!   answers a handle (`a`) and flags (`b`: [`REGISTERED_APPEND`]). The daemon keeps no copy of the
//!   descriptor (a kept copy would hold flock(2) locks past the client's close).
//! - [`Kind::Channel`]: answered with a memfd attached, [`MAP_LEN`] bytes: a new
//!   channel, served by a thread of its own in the daemon.
//!
//! When the socket closes (the process exited or was killed), the daemon closes the
//! process's channels and releases its handles. When the daemon goes, the client sees
//! the socket hang up.
//!
//! **Channel.** A [`Header`] at offset 0 and [`DATA`] bytes of data at [`HEADER`].
//! The client fills the request fields and stores [`REQUEST`] in `state`; the daemon
//! answers in the reply fields and stores [`DONE`]. Either side sleeps on `state` with
//! a futex when it has spun long enough, after raising its `*_waits` flag; the other
//! side wakes it when it sees the flag after its store (both sequentially consistent,
//! so no wake-up is lost). [`CLOSED`] ends the channel, from either side. With its
//! answer the daemon leaves its own time for the request (ns) in `c`, from which the
//! client judges how long to spin next time.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};

/// The protocol's version: a shim and a daemon of different builds refuse each other.
pub const VERSION: u64 = 1;
/// Bytes of a channel's header page.
pub const HEADER: usize = 4096;
/// Bytes of data one request carries; larger calls are split.
pub const DATA: usize = 1 << 20;
/// Bytes of a channel's mapping.
pub const MAP_LEN: usize = HEADER + DATA;

/// `state`: the daemon has answered (or nothing was asked yet); the client owns the slot.
pub const DONE: u32 = 0;
/// `state`: a request is in the slot; the daemon owns it.
pub const REQUEST: u32 = 1;
/// `state`: the channel is over.
pub const CLOSED: u32 = 2;

/// A channel's operations.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `a` offset, `b` length; answers the bytes read, into the data area.
    Read = 1,
    /// `a` offset, `b` length (data in the data area), `c` [`WRITE_APPEND`]…; answers
    /// the bytes written, and in `r1` the offset they went to.
    Write = 2,
    /// `c` 1 for fdatasync.
    Fsync = 3,
    /// Answers [`Stat`] in `stat`.
    Stat = 4,
    /// `a` the new size.
    Truncate = 5,
    /// `a` offset, `b` length, `c` mode.
    Fallocate = 6,
    /// `a` offset, `c` SEEK_DATA or SEEK_HOLE; answers the offset in `r1`.
    Seek = 7,
    /// close(2): reports a write lost after it returned, and releases the handle.
    Close = 8,
    /// Release the handle without a report (the shim registers the descriptor again).
    Release = 9,
    /// syncfs(2) of the mount.
    Syncfs = 10,
}

impl Op {
    pub fn from_u32(v: u32) -> Option<Op> {
        use Op::*;
        [Read, Write, Fsync, Stat, Truncate, Fallocate, Seek, Close, Release, Syncfs]
            .into_iter()
            .find(|o| *o as u32 == v)
    }
}

/// `b` of a [`Kind::Register`] answer: the descriptor appends (O_APPEND).
pub const REGISTERED_APPEND: u64 = 1;

/// `c` of [`Op::Write`]: make it durable before answering as `O_SYNC` (and with
/// [`WRITE_DATASYNC`] as `O_DSYNC`) asks.
pub const WRITE_SYNC: u64 = 1;
pub const WRITE_DATASYNC: u64 = 2;

/// The attributes [`Op::Stat`] answers, in the order of `Header::stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub ino: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub size: u64,
    pub blocks: u64,
    /// (seconds, nanoseconds).
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
}

const STAT_WORDS: usize = 12;

impl Stat {
    fn to_words(self) -> [u64; STAT_WORDS] {
        [
            self.ino,
            self.mode as u64 | (self.nlink as u64) << 32,
            self.uid as u64 | (self.gid as u64) << 32,
            self.rdev as u64 | (self.blksize as u64) << 32,
            self.size,
            self.blocks,
            self.atime.0 as u64,
            self.atime.1 as u64,
            self.mtime.0 as u64,
            self.mtime.1 as u64,
            self.ctime.0 as u64,
            self.ctime.1 as u64,
        ]
    }

    fn from_words(w: [u64; STAT_WORDS]) -> Stat {
        Stat {
            ino: w[0],
            mode: w[1] as u32,
            nlink: (w[1] >> 32) as u32,
            uid: w[2] as u32,
            gid: (w[2] >> 32) as u32,
            rdev: w[3] as u32,
            blksize: (w[3] >> 32) as u32,
            size: w[4],
            blocks: w[5],
            atime: (w[6] as i64, w[7] as u32),
            mtime: (w[8] as i64, w[9] as u32),
            ctime: (w[10] as i64, w[11] as u32),
        }
    }
}

/// A channel's header, at the start of its mapping. Every field is an atomic: the two
/// processes share it. The request and reply fields are written relaxed, then
/// published by the store to `state`.
#[repr(C)]
pub struct Header {
    pub state: AtomicU32,
    /// The daemon sleeps (or is about to) on `state`.
    pub server_waits: AtomicU32,
    /// The client sleeps (or is about to) on `state`.
    pub client_waits: AtomicU32,
    pub op: AtomicU32,
    pub handle: AtomicU64,
    pub a: AtomicU64,
    pub b: AtomicU64,
    pub c: AtomicU64,
    /// Non-negative: the answer; negative: -errno.
    pub result: AtomicI64,
    pub r1: AtomicU64,
    stat: [AtomicU64; STAT_WORDS],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

impl Header {
    pub fn set_stat(&self, s: Stat) {
        for (w, v) in self.stat.iter().zip(s.to_words()) {
            w.store(v, Ordering::Relaxed);
        }
    }

    pub fn stat(&self) -> Stat {
        Stat::from_words(std::array::from_fn(|i| self.stat[i].load(Ordering::Relaxed)))
    }
}

/// A session message (both directions).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Msg {
    pub kind: u32,
    /// Answers: 0 or an errno.
    pub status: u32,
    pub a: u64,
    pub b: u64,
}

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hello = 1,
    Register = 2,
    Channel = 3,
}

impl Msg {
    pub fn new(kind: Kind, a: u64) -> Msg {
        Msg { kind: kind as u32, status: 0, a, b: 0 }
    }

    fn bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.a.to_le_bytes());
        b[16..24].copy_from_slice(&self.b.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8; 24]) -> Msg {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Msg { kind: u32_at(0), status: u32_at(4), a: u64_at(8), b: u64_at(16) }
    }
}

/// The name of a mount point's files in /run/pwfs (without the extension), in the
/// manner of `systemd-escape --path`: the slashes at either end dropped, '/' turned
/// '-', and '-', '\\', '%' and a leading '.' turned `\xNN`; every other byte kept as it
/// is (a name with spaces or UTF-8 stays as short as it was: a socket's path must fit
/// 108 bytes); the root is "-". One name per mount point and back
/// (`runtime_unescape`): "/mnt/a-b" and "/mnt/a/b" are "mnt-a\x2db" and "mnt-a-b".
/// Names in the older form ('/' as '%', before 2026-11-25) start with '%', which no
/// name of this form has.
pub fn runtime_name(mountpoint: &[u8]) -> Vec<u8> {
    let mut start = 0;
    let mut end = mountpoint.len();
    while start < end && mountpoint[start] == b'/' {
        start += 1;
    }
    while end > start && mountpoint[end - 1] == b'/' {
        end -= 1;
    }
    let path = &mountpoint[start..end];
    if path.is_empty() {
        return b"-".to_vec();
    }
    let mut out = Vec::with_capacity(path.len());
    for (i, &c) in path.iter().enumerate() {
        match c {
            b'/' => out.push(b'-'),
            b'-' | b'\\' | b'%' => out.extend_from_slice(format!("\\x{c:02x}").as_bytes()),
            b'.' if i == 0 => out.extend_from_slice(b"\\x2e"),
            _ => out.push(c),
        }
    }
    out
}

/// The mount point a `runtime_name` (or a name of the older form) stands for.
pub fn runtime_unescape(name: &[u8]) -> Vec<u8> {
    if name == b"-" {
        return b"/".to_vec();
    }
    if name.first() == Some(&b'%') {
        return name.iter().map(|&c| if c == b'%' { b'/' } else { c }).collect();
    }
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = vec![b'/'];
    let mut i = 0;
    while i < name.len() {
        match name[i] {
            b'-' => out.push(b'/'),
            b'\\' if i + 3 < name.len() && name[i + 1] == b'x' => match (hex(name[i + 2]), hex(name[i + 3])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                }
                _ => out.push(b'\\'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// The socket of the mount at `mountpoint` (canonical, as in /proc/self/mountinfo):
/// /run/pwfs/ and the mount point's `runtime_name`, like the daemon's control socket.
pub fn socket_path(mountpoint: &[u8]) -> Vec<u8> {
    let mut p = b"/run/pwfs/".to_vec();
    p.extend(runtime_name(mountpoint));
    p.extend_from_slice(b".shim");
    p
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Send `m` on the seqpacket socket `sock`, with `fd` attached when it is not -1.
/// Returns 0 or an errno. Retries EINTR.
pub fn send(sock: i32, m: &Msg, fd: i32) -> i32 {
    let bytes = m.bytes();
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // u64 for alignment of the cmsghdr.
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data; every pointer in it points to a live local above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if fd >= 0 {
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        // SAFETY: CMSG_SPACE is arithmetic.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as usize;
        // SAFETY: the control buffer is CMSG_SPACE(4) bytes (32 available), so the
        // first header and its 4 data bytes are inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, fd);
        }
    }
    loop {
        // SAFETY: msg is fully set up above.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if n == bytes.len() as isize {
            return 0;
        }
        let e = if n < 0 { errno() } else { libc::EIO };
        if e != libc::EINTR {
            return e;
        }
    }
}

/// Receive one message from `sock`, and the descriptor attached to it (-1 if none; it
/// is close-on-exec). Err(0): the peer closed the socket; Err(errno) otherwise.
pub fn recv(sock: i32) -> Result<(Msg, i32), i32> {
    let mut bytes = [0u8; 24];
    let mut iov = libc::iovec { iov_base: bytes.as_mut_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut cbuf = [0u64; 4];
    loop {
        // SAFETY: as in `send`.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        // SAFETY: msg points to live locals.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = errno();
            if e == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(0);
        }
        let mut fd = -1;
        // SAFETY: the kernel filled msg_control with msg_controllen bytes of headers.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let got = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                    for i in 0..got {
                        let f = std::ptr::read_unaligned((libc::CMSG_DATA(c) as *const i32).add(i));
                        if fd < 0 {
                            fd = f;
                        } else {
                            libc::close(f);
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if n as usize != bytes.len() || msg.msg_flags & libc::MSG_TRUNC != 0 {
            if fd >= 0 {
                // SAFETY: fd was just received and is ours.
                unsafe { libc::close(fd) };
            }
            return Err(libc::EPROTO);
        }
        return Ok((Msg::from_bytes(&bytes), fd));
    }
}

/// Sleep on `word` while it holds `value`, for at most `timeout_ms` (shared futex: the
/// word is in memory shared between processes).
pub fn futex_wait(word: &AtomicU32, value: u32, timeout_ms: u64) {
    let ts =
        libc::timespec { tv_sec: (timeout_ms / 1000) as libc::time_t, tv_nsec: ((timeout_ms % 1000) * 1_000_000) as _ };
    // SAFETY: futex(2) on a valid, aligned u32; the timespec outlives the call.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, value, &ts as *const libc::timespec);
    }
}

/// Wake every sleeper on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: futex(2) on a valid, aligned u32.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// A fast clock for spin bounds (ns).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec (vDSO, no system call).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_words_round_trip() {
        let s = Stat {
            ino: 7,
            mode: 0o100644,
            nlink: 2,
            uid: 1000,
            gid: 100,
            rdev: 0,
            blksize: 4096,
            size: 1 << 40,
            blocks: 9,
            atime: (-5, 999_999_999),
            mtime: (1_700_000_000, 1),
            ctime: (0, 0),
        };
        assert_eq!(Stat::from_words(s.to_words()), s);
    }

    #[test]
    fn messages_and_descriptors_cross_a_socket() {
        let mut sv = [0i32; 2];
        // SAFETY: socketpair fills the two descriptors.
        assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, sv.as_mut_ptr()) }, 0);
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let m = Msg { kind: Kind::Register as u32, status: 3, a: u64::MAX, b: 42 };
        use std::os::fd::AsRawFd;
        assert_eq!(send(sv[0], &m, f.as_raw_fd()), 0);
        let (got, fd) = recv(sv[1]).unwrap();
        assert_eq!(got, m);
        assert!(fd >= 0 && fd != f.as_raw_fd());
        // SAFETY: plain fstat of two descriptors into zeroed stat buffers.
        let (mut a, mut b): (libc::stat, libc::stat) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        unsafe {
            assert_eq!(libc::fstat(fd, &mut a), 0);
            assert_eq!(libc::fstat(f.as_raw_fd(), &mut b), 0);
            libc::close(fd);
        }
        assert_eq!((a.st_dev, a.st_ino), (b.st_dev, b.st_ino));
        assert_eq!(send(sv[0], &Msg::new(Kind::Hello, VERSION), -1), 0);
        assert_eq!(recv(sv[1]).unwrap(), (Msg::new(Kind::Hello, VERSION), -1));
        // SAFETY: closing our own descriptor.
        unsafe { libc::close(sv[0]) };
        assert_eq!(recv(sv[1]), Err(0));
        unsafe { libc::close(sv[1]) };
    }

    #[test]
    fn the_socket_is_named_after_the_mount_point() {
        assert_eq!(socket_path(b"/mnt/a b"), b"/run/pwfs/mnt-a b.shim".to_vec());
        assert_eq!(Op::from_u32(Op::Syncfs as u32), Some(Op::Syncfs));
        assert_eq!(Op::from_u32(0), None);
    }

    /// Mount points that differ have files of different names (a '-', '%' or '\\' in
    /// a name is escaped), and each name leads back to its mount point.
    #[test]
    fn runtime_names_are_one_per_mount_point() {
        let cases: [(&[u8], &[u8]); 9] = [
            (b"/", b"-"),
            (b"/mnt/pwfs", b"mnt-pwfs"),
            (b"/mnt/a-b", b"mnt-a\\x2db"),
            (b"/mnt/a/b", b"mnt-a-b"),
            (b"/mnt/a%b", b"mnt-a\\x25b"),
            (b"/mnt/.hidden/x.y", b"mnt-.hidden-x.y"),
            (b"/.a", b"\\x2ea"),
            (b"/t/\\x2d\xff", b"t-\\x5cx2d\xff"),
            (b"/home/j\xc3\xb6rg/My Files", b"home-j\xc3\xb6rg-My Files"),
        ];
        for (mp, name) in cases {
            assert_eq!(runtime_name(mp), name.to_vec(), "{}", String::from_utf8_lossy(mp));
            assert_eq!(runtime_unescape(name), mp.to_vec(), "{}", String::from_utf8_lossy(name));
        }
        let names: std::collections::HashSet<Vec<u8>> = cases.iter().map(|(mp, _)| runtime_name(mp)).collect();
        assert_eq!(names.len(), cases.len());
        assert!(names.iter().all(|n| n.first() != Some(&b'%')));
        // A socket of a daemon started before the names changed.
        assert_eq!(runtime_unescape(b"%mnt%pwfs"), b"/mnt/pwfs".to_vec());
    }
}
