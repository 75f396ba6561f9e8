//! FUSE over io_uring (Patchwork addition; Linux 6.14+, `CONFIG_FUSE_IO_URING`, the fuse
//! module's `enable_uring` parameter).
//!
//! When the file system asks for `FUSE_OVER_IO_URING` in `init` and the kernel offers it,
//! the session registers ring entries with the kernel: one queue per possible CPU, and on
//! each queue one entry per serving thread, every thread with an io_uring of its own.
//! The kernel puts a request on the queue of the CPU its caller runs on and completes one
//! of that queue's entries with it; the thread serving the entry dispatches it like a
//! request read from /dev/fuse, and its reply goes back in the same entry together with
//! the fetch of the next request (`FUSE_IO_URING_CMD_COMMIT_AND_FETCH`): one system call
//! per request instead of a read and a write, and no shared queue between the CPUs.
//!
//! What stays on /dev/fuse: the handshake (INIT), FORGET and INTERRUPT requests, the
//! notifications the file system sends, and every request while the ring is not yet
//! ready. A failed registration turns the ring off for the connection (the kernel then
//! serves /dev/fuse only), so the /dev/fuse threads keep running either way.
//!
//! An entry is a header buffer (`fuse_uring_req_header`: the in or out header, the
//! operation's fixed argument, the entry's own in/out fields) and a payload buffer. The
//! buffers are laid out so that the in header and the fixed argument can be copied right
//! in front of the payload: the request is then one contiguous slice, parsed by the same
//! code as a /dev/fuse read, without copying the payload (a write's data).

use std::alloc::Layout;
use std::io;
use std::io::IoSlice;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::debug;
use log::error;
use log::warn;
use parking_lot::Condvar;
use parking_lot::Mutex;

use crate::Filesystem;
use crate::ReplyEmpty;
use crate::channel::Channel;
use crate::ll::Operation;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

/// `fuse_uring_req_header`: `in_out` (128 bytes), `op_in` (128), `ring_ent_in_out` (32).
const HEADER: usize = 288;
const OP_IN: usize = 128;
const ENT_IN_OUT: usize = 256;
/// `fuse_in_header` and `fuse_out_header`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// Where the payload starts in an entry's allocation: the header buffer, then room for
/// the in header and the fixed argument in front of the payload.
const PAYLOAD_AT: usize = 1024;
const PREFIX_END: usize = PAYLOAD_AT;
/// `FUSE_IO_URING_CMD_REGISTER` and `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// The kernel's smallest request buffer (`FUSE_MIN_READ_BUFFER`).
const MIN_PAYLOAD: usize = 8192;

/// A ring as the serving threads make it: 128-byte entries (the command area holds
/// `fuse_uring_cmd_req`), one submitter, completions run when the thread waits.
fn new_ring() -> io::Result<IoUring<squeue::Entry128, cqueue::Entry>> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(4)
}

/// Whether this process can make the rings (io_uring may be disabled by sysctl or
/// seccomp). Asked before the INIT reply: once the kernel has agreed to the ring it holds
/// every request until all queues are registered.
pub(crate) fn available() -> bool {
    match new_ring() {
        Ok(_) => true,
        Err(e) => {
            warn!("FUSE over io_uring not used: no io_uring here ({e})");
            false
        }
    }
}

/// The kernel's number of queues: one per possible CPU (`num_possible_cpus`).
pub(crate) fn queues() -> usize {
    let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").ok();
    possible
        .and_then(|s| count_cpus(s.trim()))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Counts the CPUs of a list such as `0-3,5,7-8`.
fn count_cpus(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                n = n.checked_add(b.checked_sub(a)?.checked_add(1)?)?;
            }
            None => {
                part.parse::<usize>().ok()?;
                n = n.checked_add(1)?;
            }
        }
    }
    (n > 0).then_some(n)
}

/// The payload buffer an entry needs: the kernel refuses smaller ones
/// (`max(FUSE_MIN_READ_BUFFER, max_write, max_pages * PAGE_SIZE)`).
pub(crate) fn payload_size(max_write: u32, max_pages: u16) -> usize {
    let pages = usize::from(max_pages) * page_size::get();
    MIN_PAYLOAD.max(max_write as usize).max(pages)
}

/// One entry's memory: the header buffer at 0, the payload at `PAYLOAD_AT`.
struct EntryMem {
    base: *mut u8,
    layout: Layout,
    payload: usize,
}

// SAFETY: the memory is owned by the entry; who may touch which part when is the
// protocol of `Slot` (the kernel between a submission and its completion, the serving
// thread or a reply otherwise).
unsafe impl Send for EntryMem {}
unsafe impl Sync for EntryMem {}

impl EntryMem {
    fn new(payload: usize) -> io::Result<EntryMem> {
        let size = PAYLOAD_AT
            .checked_add(payload)
            .ok_or_else(|| io::Error::other("payload size"))?;
        let layout = Layout::from_size_align(size, page_size::get()).map_err(io::Error::other)?;
        // SAFETY: the layout's size is not zero.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        Ok(EntryMem {
            base,
            layout,
            payload,
        })
    }

    fn payload_ptr(&self) -> *mut u8 {
        // SAFETY: within the allocation.
        unsafe { self.base.add(PAYLOAD_AT) }
    }

    fn read_u32(&self, at: usize) -> u32 {
        debug_assert!(at + 4 <= PAYLOAD_AT);
        let mut b = [0u8; 4];
        // SAFETY: `at + 4` is inside the header area.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at), b.as_mut_ptr(), 4) };
        u32::from_ne_bytes(b)
    }

    fn read_u64(&self, at: usize) -> u64 {
        debug_assert!(at + 8 <= PAYLOAD_AT);
        let mut b = [0u8; 8];
        // SAFETY: `at + 8` is inside the header area.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(at), b.as_mut_ptr(), 8) };
        u64::from_ne_bytes(b)
    }

    fn write(&self, at: usize, bytes: &[u8]) {
        debug_assert!(at + bytes.len() <= PAYLOAD_AT + self.payload);
        // SAFETY: inside the allocation; nobody else reads this part now (`Slot`).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(at), bytes.len()) };
    }
}

impl Drop for EntryMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.base, self.layout) };
    }
}

#[derive(Debug, Default)]
struct ReplyState {
    /// A request is out and its reply not yet written.
    waiting: bool,
    /// The request had no payload, so the reply may be written straight into the payload
    /// buffer (nothing the request borrows is there).
    direct: bool,
    /// The reply has been written (header in place; payload in place or in `staged`).
    done: bool,
    staged: Vec<u8>,
    len: usize,
}

/// The reply side of an entry, shared with the replies of its requests (`ReplySender`).
pub(crate) struct Slot {
    mem: EntryMem,
    state: Mutex<ReplyState>,
    cond: Condvar,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("payload", &self.mem.payload).finish()
    }
}

impl Slot {
    /// A request is out: its reply is awaited, and may go straight into the payload
    /// buffer when `direct` (the request has no payload).
    fn begin(&self, direct: bool) {
        let mut st = self.state.lock();
        st.waiting = true;
        st.done = false;
        st.direct = direct;
    }

    /// Waits for the reply (a file system may answer from another thread), puts its
    /// payload in place and its length in `ring_ent_in_out.payload_sz`.
    fn finish(&self) {
        let mut st = self.state.lock();
        while !st.done {
            self.cond.wait(&mut st);
        }
        if !st.direct {
            self.mem.write(PAYLOAD_AT, &st.staged[..st.len]);
        }
        let n = u32::try_from(st.len).unwrap_or(u32::MAX);
        self.mem.write(ENT_IN_OUT + 16, &n.to_ne_bytes());
        st.waiting = false;
        st.done = false;
    }

    /// Writes a reply (`fuse_out_header` then the payload, in `data`'s slices) into the
    /// entry. A reply too large for the payload buffer becomes EIO.
    pub(crate) fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let mut st = self.state.lock();
        if !st.waiting || st.done {
            return Err(io::Error::other("a reply for a ring entry with no request out"));
        }
        let total: usize = data.iter().map(|s| s.len()).sum();
        let mut header = [0u8; OUT_HEADER];
        let mut rest = Vec::new();
        let mut at = 0usize;
        for s in data {
            let s: &[u8] = s;
            let h = OUT_HEADER.saturating_sub(at).min(s.len());
            header[at.min(OUT_HEADER)..at.min(OUT_HEADER) + h].copy_from_slice(&s[..h]);
            if h < s.len() {
                rest.push(&s[h..]);
            }
            at += s.len();
        }
        let payload = total.saturating_sub(OUT_HEADER);
        let mut result = Ok(());
        if total < OUT_HEADER || payload > self.mem.payload {
            // An answer the entry cannot carry: tell the caller EIO instead.
            let unique = if total >= OUT_HEADER { &header[8..16] } else { &[0u8; 8][..] };
            let mut h = [0u8; OUT_HEADER];
            h[..4].copy_from_slice(&(OUT_HEADER as u32).to_ne_bytes());
            h[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            h[8..16].copy_from_slice(unique);
            header = h;
            rest.clear();
            result = Err(io::Error::other(format!("a reply of {total} bytes does not fit the ring entry")));
        }
        self.mem.write(0, &header);
        st.len = 0;
        st.staged.clear();
        for s in rest {
            if st.direct {
                self.mem.write(PAYLOAD_AT + st.len, s);
            } else {
                st.staged.extend_from_slice(s);
            }
            st.len += s.len();
        }
        st.done = true;
        self.cond.notify_one();
        result
    }
}

/// The SQE of a ring command: `cmd_op`, `fuse_uring_cmd_req { flags, commit_id, qid }` in
/// the command area, and for a registration the two iovecs (`addr`, `len` = 2).
fn command(fd: i32, op: u32, commit_id: u64, qid: u16, iovecs: Option<*const libc::iovec>) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    let mut b = opcode::UringCmd80::new(types::Fd(fd), op).cmd(cmd);
    if let Some(iov) = iovecs {
        b = b.addr(Some(iov as u64));
    }
    let entry = b.build();
    if iovecs.is_none() {
        return entry;
    }
    // The builder has no `len`; it is the SQE's 32-bit field at byte 24 (the kernel ABI's
    // `io_uring_sqe.len`), and `Entry128` is the 128-byte SQE itself (`repr(C)`).
    // SAFETY: `Entry128` is `repr(C)`, 128 bytes, plain data.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(entry) };
    raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
    // SAFETY: as above; every bit pattern of the SQE's fields is a valid value.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// Runs this thread on CPU `cpu` only: requests of that CPU's queue are then served on
/// the CPU their caller waits on (it sleeps meanwhile), with its caches warm and no
/// wake-up across CPUs. A CPU that cannot be chosen (offline, outside the cgroup's set)
/// leaves the thread where it is.
fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity take
    // valid pointers to it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            debug!("FUSE over io_uring: queue {cpu}'s threads not pinned: {}", io::Error::last_os_error());
        }
    }
}

/// Serves one entry of queue `qid` until the connection ends.
pub(crate) fn serve<FS: Filesystem>(
    se: SessionEventLoop<FS>,
    ch: Channel,
    qid: u16,
    payload: usize,
    entries: Arc<AtomicUsize>,
) -> io::Result<()> {
    let mut registered = false;
    let result = serve_entry(se, ch, qid, payload, &entries, &mut registered);
    if registered {
        entries.fetch_sub(1, Ordering::Relaxed);
    }
    result
}

fn serve_entry<FS: Filesystem>(
    se: SessionEventLoop<FS>,
    ch: Channel,
    qid: u16,
    payload: usize,
    entries: &AtomicUsize,
    registered: &mut bool,
) -> io::Result<()> {
    let fd = ch.as_fd().as_raw_fd();
    if std::env::var_os("PWFS_URING_NOPIN").is_none() {
        pin(usize::from(qid));
    }
    let mut ring = new_ring()?;
    let slot = Arc::new(Slot {
        mem: EntryMem::new(payload)?,
        state: Mutex::new(ReplyState::default()),
        cond: Condvar::new(),
    });
    let iov = [
        libc::iovec {
            iov_base: slot.mem.base.cast(),
            iov_len: HEADER,
        },
        libc::iovec {
            iov_base: slot.mem.payload_ptr().cast(),
            iov_len: payload,
        },
    ];
    let register = command(fd, CMD_REGISTER, 0, qid, Some(iov.as_ptr()));
    let mut eagain = 0u32;
    let mut next = Some(register.clone());
    loop {
        if let Some(sqe) = next.take() {
            // SAFETY: the iovecs and the buffers they point to outlive the ring (they are
            // dropped after it, at the end of this function).
            while unsafe { ring.submission().push(&sqe) }.is_err() {
                ring.submit()?;
            }
        }
        if !*registered {
            // The command is issued at submission: a refusal is in the completion queue
            // when `submit` returns; an entry taken completes only with a request.
            loop {
                match ring.submit() {
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                    r => break r.map(drop)?,
                }
            }
            if ring.completion().is_empty() {
                *registered = true;
                entries.fetch_add(1, Ordering::Relaxed);
            }
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => continue,
            Err(e) => return Err(e),
        }
        let Some(cqe) = ring.completion().next() else { continue };
        let res = cqe.result();
        if res < 0 {
            match -res {
                // The connection is not initialized yet (should not happen after INIT).
                libc::EAGAIN if !*registered && eagain < 1000 => {
                    eagain += 1;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    next = Some(register.clone());
                    continue;
                }
                libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV => return Ok(()),
                e if !*registered => {
                    // The kernel has turned the ring off for the connection; /dev/fuse
                    // serves everything.
                    warn!(
                        "FUSE over io_uring: registering queue {qid} failed ({}); serving /dev/fuse only",
                        io::Error::from_raw_os_error(e)
                    );
                    return Ok(());
                }
                e => {
                    let e = io::Error::from_raw_os_error(e);
                    error!("FUSE over io_uring: queue {qid}: {e}");
                    return Err(e);
                }
            }
        }
        if !*registered {
            *registered = true;
            entries.fetch_add(1, Ordering::Relaxed);
        }
        let commit_id = slot.mem.read_u64(ENT_IN_OUT + 8);
        let payload_len = slot.mem.read_u32(ENT_IN_OUT + 16) as usize;
        let len = slot.mem.read_u32(0) as usize;
        // The request as one slice: in header, fixed argument, payload.
        let op_len = len.checked_sub(IN_HEADER).and_then(|n| n.checked_sub(payload_len));
        let Some(op_len) = op_len.filter(|&n| n <= OP_IN && payload_len <= payload) else {
            error!("FUSE over io_uring: request of {len} bytes with a payload of {payload_len}");
            slot.begin(true);
            answer_error(&slot, commit_id, libc::EIO);
            slot.finish();
            next = Some(command(fd, CMD_COMMIT_AND_FETCH, commit_id, qid, None));
            continue;
        };
        let start = PREFIX_END - op_len - IN_HEADER;
        // SAFETY: both copies stay in the header area, which the kernel does not touch
        // until the next submission; source and target do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(slot.mem.base, slot.mem.base.add(start), IN_HEADER);
            std::ptr::copy_nonoverlapping(
                slot.mem.base.add(OP_IN),
                slot.mem.base.add(start + IN_HEADER),
                op_len,
            );
        }
        slot.begin(payload_len == 0);
        // SAFETY: `start..PAYLOAD_AT + payload_len` is inside the allocation and
        // initialized; while the slice lives, replies write only the header buffer's
        // first 16 bytes (below `start`), the payload buffer when the request has none
        // (past the slice), or a staging buffer.
        let data = unsafe { std::slice::from_raw_parts(slot.mem.base.add(start), len) };
        let mut destroy = false;
        match RequestWithSender::new(crate::reply::ReplySender::Ring(slot.clone(), ch.sender()), data) {
            Some(req) => {
                if let Ok(Operation::Destroy(_)) = req.request.operation() {
                    req.reply::<ReplyEmpty>().ok();
                    destroy = true;
                } else {
                    req.dispatch(&se);
                }
            }
            None => answer_error(&slot, commit_id, libc::EIO),
        }
        slot.finish();
        next = Some(command(fd, CMD_COMMIT_AND_FETCH, commit_id, qid, None));
        if destroy {
            if let Some(sqe) = next.take() {
                // SAFETY: as above.
                if unsafe { ring.submission().push(&sqe) }.is_ok() {
                    let _ = ring.submit();
                }
            }
            debug!("FUSE over io_uring: queue {qid} ends at DESTROY");
            return Ok(());
        }
    }
}

/// Answers the entry's request with `errno` (a request that could not be parsed).
fn answer_error(slot: &Slot, unique: u64, errno: i32) {
    let mut h = [0u8; OUT_HEADER];
    h[..4].copy_from_slice(&(OUT_HEADER as u32).to_ne_bytes());
    h[4..8].copy_from_slice(&(-errno).to_ne_bytes());
    h[8..16].copy_from_slice(&unique.to_ne_bytes());
    let _ = slot.send(&[IoSlice::new(&h)]);
}
