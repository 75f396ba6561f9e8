//! io_uring engine: O_DIRECT, registered (fixed) buffers, one ring per thread and
//! device, a bounded number of I/Os in flight, no merging and no scheduling of our own.
//!
//! Each device owns an [`Arena`] of block-sized slots. A thread's first request on a
//! device creates that thread's ring and registers the whole arena as fixed buffer 0,
//! so that page-cache buffers taken from the arena go through READ_FIXED/WRITE_FIXED
//! without per-request page pinning. Other buffers use plain or vectored ops.
//!
//! Submission and completion. `start` builds an entry per op and puts it on the calling
//! thread's ring, up to `queue_depth` entries in flight; the rest wait in the ring's
//! backlog, in order, and go on as completions make room. Every ring's user-space side
//! (submission and completion queues, backlog, in-flight count, the batches with ops
//! outstanding) is under one mutex, so that a handle can be waited for on any thread:
//! - A waiter takes the mutex, reaps what has completed, moves the backlog onto the
//!   ring and submits, and returns if its batch is done.
//! - Otherwise one waiter becomes the reaper: it sleeps in io_uring_enter for a
//!   completion *without* the mutex (the owning thread keeps submitting meanwhile), then
//!   reaps and wakes the others, who wait on a condition variable. Only the reaper reaps
//!   while it sleeps, so the completion it sleeps for cannot be taken from under it.
//! - A completion is filed under its batch (user_data: batch id and op index); the batch
//!   keeps its ops, their buffers and iovecs until its handle takes them, so memory the
//!   kernel may write into is never freed while an op is in flight. A dropped handle
//!   waits for its batch first; a leaked one leaves it with the ring, which waits for
//!   what is in flight before it is freed (and leaks the buffers if the ring is broken).

use super::medium::FileMedium;
use super::{transferred, validate, AlignedBuf, Arena, Completion, DevError, Device, Done, Op, OpKind, Pending};
use io_uring::{opcode, squeue, types, IoUring};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

pub use super::medium::Lock;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One thread's ring for one device. Shared (`Arc`) by the thread that made it, which
/// submits on it, and the handles of batches on it, which any thread may wait for.
struct Ring {
    ring: IoUring,
    /// The arena is registered as fixed buffer 0.
    fixed: bool,
    /// The kernel has READV_FIXED/WRITEV_FIXED (6.15+): vectored ops skip page pinning.
    vec_fixed: bool,
    /// Maximum entries in flight.
    depth: u32,
    state: Mutex<RingState>,
    /// Signalled when the reaper has reaped.
    reaped: Condvar,
    /// Hybrid polling: how long the reaper spins before it sleeps (ns).
    spin_ns: Arc<AtomicU64>,
}

struct RingState {
    /// A thread sleeps in io_uring_enter for completions; only it reaps until it wakes.
    reaping: bool,
    /// Entries on the ring (in the submission queue or the kernel) not yet reaped.
    in_flight: u32,
    /// Entries waiting for room on the ring, in submission order.
    backlog: VecDeque<squeue::Entry>,
    /// Batches whose handles have not taken their results, by id.
    batches: HashMap<u32, Batch>,
    next_id: u32,
}

/// The ops of one `start`, kept here until their handle takes them.
struct Batch {
    ops: Vec<Op>,
    /// The iovec arrays the vectored entries point at.
    _iovs: Vec<Iovecs>,
    results: Vec<Option<Result<(), DevError>>>,
    /// Ops on the ring or in the backlog.
    outstanding: usize,
    /// Keeps the descriptor in the entries open.
    _medium: Arc<FileMedium>,
}

/// The iovec array of a vectored op, at a fixed heap address while the op is in flight.
struct Iovecs(Vec<libc::iovec>);

// SAFETY: the pointers point into buffers of the same batch, which moves with them.
unsafe impl Send for Iovecs {}

/// A thread's ring for a device.
struct ThreadRing {
    device: u64,
    /// Gone once the device (and every batch on the ring) is.
    alive: Weak<FileMedium>,
    ring: Arc<Ring>,
}

thread_local! {
    static RINGS: RefCell<Vec<ThreadRing>> = const { RefCell::new(Vec::new()) };
}

pub struct UringDevice {
    medium: Arc<FileMedium>,
    id: u64,
    arena: Arc<Arena>,
    depth: u32,
    /// How long a waiter spins before it sleeps (ns; 0: no polling). Shared with the
    /// rings.
    spin_ns: Arc<AtomicU64>,
}

#[derive(Debug, Clone)]
pub struct UringOptions {
    /// Bytes of registered buffer memory (block-sized slots).
    pub arena_bytes: usize,
    /// Maximum I/Os in flight per ring.
    pub queue_depth: u32,
    /// Open with O_DIRECT (bypass the kernel page cache).
    pub direct: bool,
    /// Advisory lock on the image (flock), taken without waiting.
    pub lock: Lock,
    /// Hybrid polling: a waiter spins on the completion queue before it sleeps, for
    /// a time calibrated when the device opens (1.5x the median of eight 4 KiB reads,
    /// 5-200 us). IOPOLL is not used: it needs a device with poll queues.
    pub poll: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions { arena_bytes: 64 << 20, queue_depth: 64, direct: true, lock: Lock::None, poll: false }
    }
}

impl UringDevice {
    pub fn open(path: &Path, opts: &UringOptions) -> std::io::Result<UringDevice> {
        UringDevice::on(FileMedium::open(path, opts.direct, opts.lock)?, opts)
    }

    pub fn from_file(file: File, len: u64, opts: &UringOptions) -> std::io::Result<UringDevice> {
        UringDevice::on(FileMedium::new(file, len), opts)
    }

    pub fn on(medium: FileMedium, opts: &UringOptions) -> std::io::Result<UringDevice> {
        let slots = (opts.arena_bytes / 4096).max(16);
        // Probe that io_uring works here at all, so that open fails cleanly rather than
        // the first request.
        IoUring::new(2)?;
        let dev = UringDevice {
            medium: Arc::new(medium),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            arena: Arena::new(4096, slots)?,
            depth: opts.queue_depth.clamp(1, 4096),
            spin_ns: Arc::new(AtomicU64::new(0)),
        };
        if opts.poll {
            dev.spin_ns.store(dev.calibrate_spin().as_nanos() as u64, Ordering::Relaxed);
        }
        Ok(dev)
    }

    /// The spin time of hybrid polling: 1.5x the median latency of eight 4 KiB reads
    /// spread over the device, within 5-200 us (a read that takes longer than that is
    /// slept for: spinning through it would cost a core for little).
    fn calibrate_spin(&self) -> std::time::Duration {
        use std::time::{Duration, Instant};
        let len = self.medium.len();
        let mut lat: Vec<Duration> = (0..8u64)
            .filter_map(|i| {
                let at = (len / 8 * i) / 4096 * 4096;
                (at + 4096 <= len).then_some(at)
            })
            .filter_map(|at| {
                let t = Instant::now();
                let (_, r) = self.read(at, self.alloc(4096));
                r.ok().map(|()| t.elapsed())
            })
            .collect();
        lat.sort();
        let median = lat.get(lat.len() / 2).copied().unwrap_or(Duration::from_micros(50));
        (median * 3 / 2).clamp(Duration::from_micros(5), Duration::from_micros(200))
    }

    /// The spin time of hybrid polling (zero: off).
    pub fn poll_spin(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed))
    }

    /// This thread's ring for this device; the errno if one cannot be set up (out of
    /// file descriptors or locked memory): the I/O fails with it, nothing panics.
    fn ring(&self) -> Result<Arc<Ring>, i32> {
        RINGS.with(|rings| {
            let mut rings = rings.borrow_mut();
            if let Some(r) = rings.iter().find(|r| r.device == self.id) {
                return Ok(r.ring.clone());
            }
            // Forget rings of devices that are gone before adding one (a handle still
            // waiting on one keeps it alive).
            rings.retain(|r| r.alive.strong_count() > 0);
            let ring =
                IoUring::new(self.depth.next_power_of_two()).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
            let iov = libc::iovec { iov_base: self.arena.base() as *mut libc::c_void, iov_len: self.arena.bytes() };
            // SAFETY: the registration pins the arena's pages in the kernel, and fixed
            // entries are built only for buffers of this arena, each holding it mapped.
            let fixed = unsafe { ring.submitter().register_buffers(&[iov]) }.is_ok();
            let mut probe = io_uring::Probe::new();
            let vec_fixed = fixed
                && ring.submitter().register_probe(&mut probe).is_ok()
                && probe.is_supported(opcode::ReadvFixed::CODE)
                && probe.is_supported(opcode::WritevFixed::CODE);
            let ring = Arc::new(Ring {
                ring,
                fixed,
                vec_fixed,
                depth: self.depth,
                state: Mutex::new(RingState {
                    reaping: false,
                    in_flight: 0,
                    backlog: VecDeque::new(),
                    batches: HashMap::new(),
                    next_id: 0,
                }),
                reaped: Condvar::new(),
                spin_ns: self.spin_ns.clone(),
            });
            rings.push(ThreadRing { device: self.id, alive: Arc::downgrade(&self.medium), ring: ring.clone() });
            Ok(ring)
        })
    }

    /// Registered buffers not in use (tests).
    #[cfg(test)]
    pub(crate) fn free_slots(&self) -> usize {
        self.arena.free_slots()
    }

    /// Entries in flight on this thread's ring (tests).
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> u32 {
        self.ring().expect("a ring").state.lock().in_flight
    }

    fn entry(&self, ring: &Ring, op: &mut Op, iovs: &mut Iovecs, drain: bool) -> squeue::Entry {
        let fd = types::Fd(self.medium.fd());
        let dsync = if op.kind == OpKind::WriteFua { libc::RWF_DSYNC } else { 0 };
        let write = op.kind.is_write();
        if op.kind == OpKind::Flush {
            let e = opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build();
            return if drain { e.flags(squeue::Flags::IO_DRAIN) } else { e };
        }
        if op.bufs.len() == 1 {
            let own = op.bufs[0].arena().is_some_and(|a| Arc::ptr_eq(a, &self.arena));
            let b = &mut op.bufs[0];
            let (ptr, len, at) = (b.as_mut_ptr(), b.len() as u32, op.offset);
            return match (write, own && ring.fixed) {
                (false, true) => opcode::ReadFixed::new(fd, ptr, len, 0).offset(at).build(),
                (true, true) => opcode::WriteFixed::new(fd, ptr, len, 0).offset(at).rw_flags(dsync).build(),
                (false, false) => opcode::Read::new(fd, ptr, len).offset(at).build(),
                (true, false) => opcode::Write::new(fd, ptr, len).offset(at).rw_flags(dsync).build(),
            };
        }
        iovs.0 = op
            .bufs
            .iter_mut()
            .map(|b| libc::iovec { iov_base: b.as_mut_ptr() as *mut libc::c_void, iov_len: b.len() })
            .collect();
        // All buffers in the registered arena: the kernel need not pin their pages.
        let fixed_vec =
            ring.vec_fixed && op.bufs.iter().all(|b| b.arena().is_some_and(|a| Arc::ptr_eq(a, &self.arena)));
        let (ptr, n, at) = (iovs.0.as_ptr(), iovs.0.len() as u32, op.offset);
        match (write, fixed_vec) {
            (false, true) => opcode::ReadvFixed::new(fd, ptr, n, 0).offset(at).build(),
            (true, true) => opcode::WritevFixed::new(fd, ptr, n, 0).offset(at).rw_flags(dsync).build(),
            (false, false) => opcode::Readv::new(fd, ptr, n).offset(at).build(),
            (true, false) => opcode::Writev::new(fd, ptr, n).offset(at).rw_flags(dsync).build(),
        }
    }
}

/// Every op of a batch that could not be started, failed with `errno`.
fn failed(ops: Vec<Op>, errno: i32) -> Vec<Done> {
    ops.into_iter().map(|op| Done { bufs: op.bufs, result: Err(DevError::Io(errno)) }).collect()
}

/// Take what has completed off the completion queue and file it under its batch.
fn reap(ring: &IoUring, st: &mut RingState) {
    debug_assert!(!st.reaping, "only the reaper reaps while it sleeps");
    // SAFETY: the caller holds the state (locked, or owned) and no reaper sleeps: this is
    // the only user of the completion queue.
    let cq = unsafe { ring.completion_shared() };
    for cqe in cq {
        st.in_flight -= 1;
        let (id, i) = ((cqe.user_data() >> 32) as u32, cqe.user_data() as u32 as usize);
        let Some(b) = st.batches.get_mut(&id) else {
            debug_assert!(false, "completion for no batch: {:#x}", cqe.user_data());
            continue;
        };
        let res = cqe.result() as i64;
        b.results[i] = Some(match b.ops[i].kind {
            OpKind::Flush if res < 0 => Err(DevError::Io(-res as i32)),
            OpKind::Flush => Ok(()),
            _ => transferred(res, b.ops[i].len()),
        });
        b.outstanding -= 1;
    }
}

/// Sleep in io_uring_enter until the ring has a completion.
fn enter_wait(ring: &IoUring) -> Result<(), i32> {
    loop {
        // SAFETY: no entries submitted and no argument: this only waits.
        match unsafe { ring.submitter().enter::<libc::sigset_t>(0, 1, io_uring::EnterFlags::GETEVENTS.bits(), None) } {
            Ok(_) => return Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => continue,
            Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EIO)),
        }
    }
}

impl Ring {
    /// Move backlog entries onto the ring while there is room, and submit.
    fn push(&self, st: &mut RingState) -> Result<(), i32> {
        let queued = {
            // SAFETY: the state lock is held: this is the only user of the submission
            // queue (a sleeping reaper does not touch it).
            let mut sq = unsafe { self.ring.submission_shared() };
            while st.in_flight < self.depth {
                let Some(e) = st.backlog.front() else { break };
                // SAFETY: the entry's buffers and iovecs belong to a batch in
                // `st.batches`, which keeps them alive and unmoved until it is reaped.
                if unsafe { sq.push(e) }.is_err() {
                    break;
                }
                st.backlog.pop_front();
                st.in_flight += 1;
            }
            sq.len()
        };
        if queued == 0 {
            return Ok(());
        }
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => continue,
                Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EIO)),
            }
        }
    }

    /// Block until `ready` holds, reaping as needed; returns the state locked. Fails
    /// only if the ring is broken (io_uring_enter failed with the errno).
    fn wait_until(&self, mut ready: impl FnMut(&RingState) -> bool) -> Result<MutexGuard<'_, RingState>, i32> {
        let mut st = self.state.lock();
        loop {
            if !st.reaping {
                reap(&self.ring, &mut st);
            }
            self.push(&mut st)?;
            if ready(&st) {
                return Ok(st);
            }
            if st.reaping {
                self.reaped.wait(&mut st);
                continue;
            }
            if st.in_flight == 0 {
                // Nothing can complete: the condition waits for something not on the
                // ring (a bug); let the caller see it rather than sleep forever.
                debug_assert!(false, "waiting on a ring with nothing in flight");
                return Ok(st);
            }
            st.reaping = true;
            let r = MutexGuard::unlocked(&mut st, || self.await_completion());
            st.reaping = false;
            self.reaped.notify_all();
            r?;
        }
    }

    /// The reaper's wait for a completion: with hybrid polling, spin on the
    /// completion queue first (the owner keeps submitting meanwhile: the state lock
    /// is not held); then sleep in the kernel.
    fn await_completion(&self) -> Result<(), i32> {
        let spin = self.spin_ns.load(Ordering::Relaxed);
        if spin > 0 {
            let t = std::time::Instant::now();
            loop {
                // SAFETY: only the reaper uses the completion queue while it waits,
                // and it only looks at the queue's length here.
                if !unsafe { self.ring.completion_shared() }.is_empty() {
                    return Ok(());
                }
                if t.elapsed().as_nanos() as u64 >= spin {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        enter_wait(&self.ring)
    }

    /// Whether there is room for more work: nothing waiting and a free slot.
    fn has_room(&self, st: &RingState) -> bool {
        st.backlog.is_empty() && st.in_flight < self.depth
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Batches of leaked handles may still be in flight: their buffers are freed
        // with the state below, so wait for them first, or leak them if the ring fails.
        let (ring, st) = (&self.ring, self.state.get_mut());
        reap(ring, st);
        while st.in_flight > 0 {
            if enter_wait(ring).is_err() {
                std::mem::forget(std::mem::take(&mut st.batches));
                return;
            }
            reap(ring, st);
        }
    }
}

/// The handle side of a batch on a ring.
struct UringPending {
    ring: Arc<Ring>,
    /// None once the results are taken.
    id: Option<u32>,
}

impl UringPending {
    fn done(st: &RingState, id: u32) -> bool {
        st.batches.get(&id).is_none_or(|b| b.outstanding == 0)
    }
}

impl Completion for UringPending {
    fn poll(&mut self) -> bool {
        let Some(id) = self.id else { return true };
        let mut st = self.ring.state.lock();
        if !st.reaping {
            reap(&self.ring.ring, &mut st);
        }
        if let Err(e) = self.ring.push(&mut st) {
            drop(st);
            panic!("io_uring_enter failed: {}", std::io::Error::from_raw_os_error(e));
        }
        UringPending::done(&st, id)
    }

    fn wait(&mut self) -> Vec<Done> {
        let id = self.id.expect("waited once");
        let mut st = match self.ring.wait_until(|st| UringPending::done(st, id)) {
            Ok(st) => st,
            // The ring itself is broken: nothing here can recover the I/O in flight
            // (the batch stays with the ring, which leaks it).
            Err(e) => panic!("io_uring_enter failed: {}", std::io::Error::from_raw_os_error(e)),
        };
        let b = st.batches.remove(&id).expect("a batch per handle");
        drop(st);
        self.id = None;
        b.ops
            .into_iter()
            .zip(b.results)
            .map(|(op, r)| Done { bufs: op.bufs, result: r.expect("every op completed") })
            .collect()
    }
}

impl Drop for UringPending {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        // Also while unwinding: wait for the batch before its buffers are freed. A
        // broken ring keeps the batch (and leaks it); never panic here.
        if let Ok(mut st) = self.ring.wait_until(|st| UringPending::done(st, id)) {
            let b = st.batches.remove(&id);
            drop(st);
            drop(b);
        }
    }
}

impl Device for UringDevice {
    fn len(&self) -> u64 {
        self.medium.len()
    }

    fn alloc(&self, len: usize) -> AlignedBuf {
        self.arena.alloc(len).unwrap_or_else(|| AlignedBuf::new(len))
    }

    fn start(&self, mut ops: Vec<Op>) -> Pending {
        assert!(ops.len() <= u32::MAX as usize, "batch too large");
        let ring = match self.ring() {
            Ok(ring) => ring,
            Err(e) => return Pending::ready(failed(ops, e)),
        };
        let results: Vec<Option<Result<(), DevError>>> =
            ops.iter().map(|op| validate(op, self.medium.len()).err().map(Err)).collect();
        let mut iovs: Vec<Iovecs> = ops.iter().map(|_| Iovecs(Vec::new())).collect();
        let mut st = ring.state.lock();
        let id = loop {
            let id = st.next_id;
            st.next_id = st.next_id.wrapping_add(1);
            if !st.batches.contains_key(&id) {
                break id;
            }
        };
        let mut outstanding = 0;
        // A flush after a write of its batch waits for everything before it on the ring.
        let mut wrote = false;
        for (i, op) in ops.iter_mut().enumerate() {
            if results[i].is_some() {
                continue;
            }
            let e = self.entry(&ring, op, &mut iovs[i], wrote).user_data((id as u64) << 32 | i as u64);
            wrote |= op.kind.is_write();
            st.backlog.push_back(e);
            outstanding += 1;
        }
        if outstanding == 0 {
            drop(st);
            let done = ops.into_iter().zip(results).map(|(op, r)| Done { bufs: op.bufs, result: r.expect("checked") });
            return Pending::ready(done.collect());
        }
        st.batches.insert(id, Batch { ops, _iovs: iovs, results, outstanding, _medium: self.medium.clone() });
        if !st.reaping {
            reap(&ring.ring, &mut st);
        }
        if let Err(e) = ring.push(&mut st) {
            drop(st);
            // The batch stays with the ring, which leaks it.
            panic!("io_uring_enter failed: {}", std::io::Error::from_raw_os_error(e));
        }
        drop(st);
        Pending::new(Box::new(UringPending { ring, id: Some(id) }))
    }

    fn submit_stream(&self, next: &mut dyn FnMut() -> Option<Vec<Op>>) -> Vec<Done> {
        // Ask for more work only when everything so far is on the ring and there is
        // room; the producer runs (and may do I/O of its own, on the same ring) outside
        // the ring's lock.
        let ring = match self.ring() {
            Ok(ring) => ring,
            Err(e) => return std::iter::from_fn(next).flat_map(|ops| failed(ops, e)).collect(),
        };
        let mut started = Vec::new();
        loop {
            if let Err(e) = ring.wait_until(|st| ring.has_room(st)) {
                panic!("io_uring_enter failed: {}", std::io::Error::from_raw_os_error(e));
            }
            match next() {
                Some(ops) => started.push(self.start(ops)),
                None => break,
            }
        }
        started.into_iter().flat_map(Pending::wait).collect()
    }

    fn name(&self) -> &'static str {
        "uring"
    }
}
