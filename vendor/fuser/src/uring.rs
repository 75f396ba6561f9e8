//! FUSE over io_uring (Patchwork addition; Linux 6.14+, `CONFIG_FUSE_IO_URING`, the fuse
//! module's `enable_uring` parameter).
//!
//! When the file system asks for `FUSE_OVER_IO_URING` in `init` and the kernel offers it,
//! the session registers ring entries with the kernel: one queue per possible CPU, the
//! session's serving threads spread over the online CPUs' queues (one for an offline
//! CPU's), each thread with an io_uring of its own and one entry.
//! The kernel puts a request on the queue of the CPU its caller runs on and completes one
//! of that queue's entries with it; the thread serving the entry dispatches it like a
//! request read from /dev/fuse, and its reply goes back in the same entry together with
//! the fetch of the next request (`FUSE_IO_URING_CMD_COMMIT_AND_FETCH`): one system call
//! per request instead of a read and a write, and no shared queue between the CPUs.
//!
//! What stays on /dev/fuse: the handshake (INIT), FORGET and INTERRUPT requests and the
//! notifications the file system sends. Until every queue has an entry the kernel holds
//! new requests; a queue that cannot get one makes the session turn the ring off for the
//! connection (`Plan::turn_off`), and /dev/fuse serves everything, so the /dev/fuse
//! threads keep running either way.
//!
//! After an answer, the thread that gave it polls its ring for a while (the session's
//! `uring_spin`) when no other request is being served: a synchronous caller's next
//! request is then taken without waking a sleeping thread.
//!
//! An entry is a header buffer (`fuse_uring_req_header`: the in or out header, the
//! operation's fixed argument, the entry's own in/out fields) and a payload buffer. The
//! buffers are laid out so that the in header and the fixed argument can be copied right
//! in front of the payload: the request is then one contiguous slice, parsed by the same
//! code as a /dev/fuse read, without copying the payload (a write's data).

use std::io;
use std::io::IoSlice;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

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
use crate::reply::ReplySender;
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
/// `IORING_ENTER_GETEVENTS`.
const IORING_ENTER_GETEVENTS: u32 = 1;
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

/// What a session's serving threads share: how many are serving a request now, and
/// whether one of them is polling for the next.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    busy: AtomicUsize,
    polling: AtomicBool,
}

/// A request being served, counted in `Shared::busy` until dropped (also by a panic).
struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn new(busy: &'a AtomicUsize) -> Busy<'a> {
        busy.fetch_add(1, Ordering::Relaxed);
        Busy(busy)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The CPUs of a list such as `0-3,5,7-8` (the kernel's cpu list format).
fn cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let a = part.parse::<usize>().ok()?;
                (a, a)
            }
        };
        if b < a || b - a > 1 << 16 {
            return None;
        }
        cpus.extend(a..=b);
    }
    (!cpus.is_empty()).then_some(cpus)
}

fn read_cpus(what: &str) -> Option<Vec<usize>> {
    cpu_list(&std::fs::read_to_string(format!("/sys/devices/system/cpu/{what}")).ok()?)
}

/// What the session needs to serve the ring, settled before the INIT reply: once the
/// kernel has agreed to the ring it holds every request until each queue has an entry,
/// so nothing that can fail is left for later without a way back (`turn_off`).
pub(crate) struct Plan {
    /// The kernel's queues: one per possible CPU (`num_possible_cpus`); a request goes
    /// to the queue of the CPU its caller runs on.
    queues: usize,
    /// Which queues belong to online CPUs.
    online: Vec<bool>,
    /// Each entry's payload buffer: the kernel refuses smaller ones
    /// (`max(FUSE_MIN_READ_BUFFER, max_write, max_pages * PAGE_SIZE)`).
    payload: usize,
    /// A ring any thread may submit to, kept to turn the ring off.
    spare: IoUring<squeue::Entry128, cqueue::Entry>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan").field("queues", &self.queues).field("payload", &self.payload).finish()
    }
}

impl Plan {
    /// The plan, or `None` (with the reason logged) when this process cannot serve the
    /// ring: io_uring refused (sysctl, seccomp), or the CPUs not known.
    pub(crate) fn new(max_write: u32, max_pages: u16) -> Option<Plan> {
        let spare = match IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2).and_then(|r| {
            new_ring()?;
            Ok(r)
        }) {
            Ok(r) => r,
            Err(e) => {
                warn!("FUSE over io_uring not used: no io_uring here ({e})");
                return None;
            }
        };
        let (Some(possible), Some(online)) = (read_cpus("possible"), read_cpus("online")) else {
            warn!("FUSE over io_uring not used: the CPUs are not known (/sys/devices/system/cpu)");
            return None;
        };
        let queues = possible.len();
        if u16::try_from(queues).is_err() {
            warn!("FUSE over io_uring not used: {queues} queues");
            return None;
        }
        let online = (0..queues).map(|q| online.contains(&q)).collect();
        let pages = usize::from(max_pages) * page_size::get();
        let payload = MIN_PAYLOAD.max(max_write as usize).max(pages);
        Some(Plan {
            queues,
            online,
            payload,
            spare,
        })
    }

    pub(crate) fn queues(&self) -> u16 {
        // Checked in `new`.
        self.queues as u16
    }

    pub(crate) fn payload(&self) -> usize {
        self.payload
    }

    /// Serving threads (one entry each) for `qid`: the session's thread count spread
    /// over the online CPUs, and one for a queue no CPU is online for.
    pub(crate) fn threads_for(&self, qid: u16, n_threads: usize) -> usize {
        let online = self.online.iter().filter(|&&o| o).count().max(1);
        match self.online.get(usize::from(qid)) {
            Some(true) => n_threads.div_ceil(online).max(1),
            _ => 1,
        }
    }

    /// Turns the ring off for the connection: a registration the kernel refuses (a
    /// queue that does not exist) clears its `io_uring` flag, and requests that waited
    /// for the ring go to /dev/fuse. For when a queue cannot get its entries.
    pub(crate) fn turn_off(&mut self, fd: i32) {
        let iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        let sqe = command(fd, CMD_REGISTER, 0, u16::MAX, Some(iov.as_ptr()));
        // SAFETY: the iovecs outlive the submission, which the kernel refuses before
        // it reads them (the queue number is checked first).
        let pushed = unsafe { self.spare.submission().push(&sqe) }.is_ok();
        match pushed.then(|| self.spare.submit_and_wait(1)) {
            Some(Ok(_)) => {
                let res = self.spare.completion().next().map(|c| c.result());
                warn!("FUSE over io_uring turned off for this mount; /dev/fuse serves it (refusal: {res:?})");
            }
            other => error!("FUSE over io_uring: could not turn the ring off ({other:?}); requests may wait"),
        }
    }
}

/// One entry's memory: the header buffer at 0, the payload at `PAYLOAD_AT`.
struct EntryMem {
    base: *mut u8,
    size: usize,
    payload: usize,
}

// SAFETY: the memory is owned by the entry; who may touch which part when is the
// protocol of `Slot` (the kernel between a submission and its completion, the serving
// thread or a reply otherwise).
unsafe impl Send for EntryMem {}
unsafe impl Sync for EntryMem {}

impl EntryMem {
    /// Anonymous memory: zero pages until touched, so an entry costs what its largest
    /// request or reply used.
    fn new(payload: usize) -> io::Result<EntryMem> {
        let size = PAYLOAD_AT
            .checked_add(payload)
            .ok_or_else(|| io::Error::other("payload size"))?;
        // SAFETY: a private anonymous mapping of `size` bytes, no file.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(EntryMem {
            base: base.cast(),
            size,
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
        // SAFETY: mapped in `new` with this size.
        unsafe { libc::munmap(self.base.cast(), self.size) };
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
    /// The request's `unique`, for a reply the entry cannot carry.
    unique: u64,
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
    fn begin(&self, direct: bool, unique: u64) {
        let mut st = self.state.lock();
        st.waiting = true;
        st.done = false;
        st.direct = direct;
        st.unique = unique;
    }

    /// Whether the request out has no reply yet.
    fn pending(&self) -> bool {
        let st = self.state.lock();
        st.waiting && !st.done
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
        let payload = total.saturating_sub(OUT_HEADER);
        let fits = total >= OUT_HEADER && payload <= self.mem.payload;
        // The header is the first 16 bytes of the slices, the payload the rest.
        let mut header = [0u8; OUT_HEADER];
        let mut need = OUT_HEADER;
        st.len = 0;
        st.staged.clear();
        for s in data.iter().map(|s| &s[..]).filter(|_| fits) {
            let h = need.min(s.len());
            header[OUT_HEADER - need..OUT_HEADER - need + h].copy_from_slice(&s[..h]);
            need -= h;
            let s = &s[h..];
            if st.direct {
                self.mem.write(PAYLOAD_AT + st.len, s);
            } else {
                st.staged.extend_from_slice(s);
            }
            st.len += s.len();
        }
        if !fits {
            // An answer the entry cannot carry: tell the caller EIO instead.
            header[..4].copy_from_slice(&(OUT_HEADER as u32).to_ne_bytes());
            header[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            header[8..16].copy_from_slice(&st.unique.to_ne_bytes());
        }
        self.mem.write(0, &header);
        let result = match fits {
            true => Ok(()),
            false => Err(io::Error::other(format!("a reply of {total} bytes does not fit the ring entry"))),
        };
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

/// Serves one entry of queue `qid` until the connection ends. `ready` hears once
/// whether the entry was registered.
pub(crate) fn serve<FS: Filesystem>(
    se: SessionEventLoop<FS>,
    ch: Channel,
    qid: u16,
    payload: usize,
    ready: mpsc::Sender<(u16, bool)>,
    shared: Arc<Shared>,
    spin: Duration,
) -> io::Result<()> {
    let mut ready = Some(ready);
    let result = serve_entry(se, ch, qid, payload, &shared, spin, &mut |ok| {
        if let Some(r) = ready.take() {
            let _ = r.send((qid, ok));
        }
    });
    if let Some(r) = ready.take() {
        let _ = r.send((qid, false));
    }
    result
}

fn serve_entry<FS: Filesystem>(
    se: SessionEventLoop<FS>,
    ch: Channel,
    qid: u16,
    payload: usize,
    shared: &Shared,
    spin: Duration,
    registered: &mut dyn FnMut(bool),
) -> io::Result<()> {
    let fd = ch.as_fd().as_raw_fd();
    // Made before the ring, so dropped after it: the kernel's hold on the buffers ends
    // with the ring.
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
    let mut ring = new_ring()?;
    let register = command(fd, CMD_REGISTER, 0, qid, Some(iov.as_ptr()));
    // SAFETY: the iovecs and the buffers they point to outlive the ring.
    while unsafe { ring.submission().push(&register) }.is_err() {
        ring.submit()?;
    }
    // The command is issued at submission: a refusal is in the completion queue when
    // `submit` returns; an entry taken completes only with a request.
    let mut tries = 0;
    loop {
        match ring.submit() {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) && tries < 1000 => {
                tries += 1;
                std::thread::sleep(Duration::from_micros(100));
            }
            r => break r.map(drop)?,
        }
    }
    let refused = ring.completion().next().map(|c| c.result());
    registered(refused.is_none());
    if let Some(res) = refused {
        return match -res {
            // The connection ended (unmount, abort) before the entry was taken.
            libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV => Ok(()),
            e => {
                let e = io::Error::from_raw_os_error(e);
                warn!("FUSE over io_uring: queue {qid} refused an entry ({e})");
                Err(e)
            }
        };
    }
    let mut next: Option<squeue::Entry128> = None;
    loop {
        if let Some(sqe) = next.take() {
            // SAFETY: a commit carries no pointers.
            while unsafe { ring.submission().push(&sqe) }.is_err() {
                ring.submit()?;
            }
        }
        // A synchronous caller's next request usually follows within microseconds of
        // the answer: one thread of the session (normally the one that answered last,
        // whose entry the kernel hands out first) polls for it while nothing else is
        // being served, instead of going to sleep and being woken (on this
        // 2-vCPU VM a wake-up of an idle CPU is most of a request's cost; DECISIONS).
        let poll = !spin.is_zero()
            && shared.busy.load(Ordering::Relaxed) == 0
            && !shared.polling.swap(true, Ordering::Acquire);
        if poll {
            // At most a second (a longer spin would only waste a CPU, and cannot overflow).
            let until = std::time::Instant::now() + spin.min(Duration::from_secs(1));
            let _ = ring.submit();
            while ring.completion().is_empty()
                && shared.busy.load(Ordering::Relaxed) == 0
                && std::time::Instant::now() < until
            {
                // Runs the ring's deferred work (a request handed to the entry) and
                // posts its completion; then gives the CPU to any runnable thread.
                // SAFETY: no submissions, no argument.
                let _ = unsafe { ring.submitter().enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None) };
                // SAFETY: no arguments.
                unsafe { libc::sched_yield() };
            }
            shared.polling.store(false, Ordering::Release);
        }
        if ring.completion().is_empty() {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => continue,
                Err(e) => return Err(e),
            }
        }
        let Some(cqe) = ring.completion().next() else { continue };
        let res = cqe.result();
        if res < 0 {
            return match -res {
                // The connection ends (unmount, abort) or the ring closes.
                libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV => Ok(()),
                e => {
                    let e = io::Error::from_raw_os_error(e);
                    error!("FUSE over io_uring: queue {qid} lost an entry: {e}");
                    Err(e)
                }
            };
        }
        let commit_id = slot.mem.read_u64(ENT_IN_OUT + 8);
        let payload_len = slot.mem.read_u32(ENT_IN_OUT + 16) as usize;
        let len = slot.mem.read_u32(0) as usize;
        // The request as one slice: in header, fixed argument, payload.
        let op_len = len.checked_sub(IN_HEADER).and_then(|n| n.checked_sub(payload_len));
        let Some(op_len) = op_len.filter(|&n| n <= OP_IN && payload_len <= payload) else {
            error!("FUSE over io_uring: request of {len} bytes with a payload of {payload_len}");
            slot.begin(true, commit_id);
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
        slot.begin(payload_len == 0, commit_id);
        let busy = Busy::new(&shared.busy);
        // SAFETY: `start..PAYLOAD_AT + payload_len` is inside the mapping and was written
        // by the kernel or above; while the slice lives, replies write only the header
        // buffer's first 16 bytes (below `start`), the payload buffer when the request
        // has none (past the slice), or a staging buffer.
        let data = unsafe { std::slice::from_raw_parts(slot.mem.base.add(start), len) };
        let mut destroy = false;
        match RequestWithSender::new(ReplySender::Ring(slot.clone(), ch.sender()), data) {
            Some(req) => {
                if let Ok(Operation::Destroy(_)) = req.request.operation() {
                    req.reply::<ReplyEmpty>().ok();
                    destroy = true;
                } else if std::panic::catch_unwind(AssertUnwindSafe(|| req.dispatch(&se))).is_err() {
                    // A handler that panics has its reply dropped, which answers EIO
                    // (`ReplyRaw`); the entry serves on, as a /dev/fuse thread's
                    // siblings would.
                    error!("FUSE over io_uring: a request handler panicked");
                    if slot.pending() {
                        answer_error(&slot, commit_id, libc::EIO);
                    }
                }
            }
            None => answer_error(&slot, commit_id, libc::EIO),
        }
        slot.finish();
        drop(busy);
        next = Some(command(fd, CMD_COMMIT_AND_FETCH, commit_id, qid, None));
        if destroy {
            if let Some(sqe) = next.take() {
                // SAFETY: a commit carries no pointers.
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
