//! device: how requests reach where bytes live.
//!
//! Interface. A [`Device`] takes a batch of [`Op`]s, each owning its [`AlignedBuf`]s,
//! and gives every buffer back in a [`Done`] with the op's result, even on error.
//!
//! - [`Device::start`] puts a batch on the device and returns a [`Pending`] at once,
//!   without waiting for the I/O. [`Pending::wait`] blocks until every op has completed
//!   and returns one `Done` per op, in the order of the ops; [`Pending::is_done`] and
//!   [`Pending::try_done`] poll without blocking. [`Device::submit`] is
//!   `start(ops).wait()`; `read`, `write` and `flush` are one-op batches.
//! - Ops: [`OpKind::Read`], [`OpKind::Write`], [`OpKind::WriteFua`] (durable when it
//!   completes, like a write with FUA: it needs no flush, and makes no other write
//!   durable) and [`OpKind::Flush`] (no buffers: makes durable every write that completed
//!   before its batch was started, and every write before it in its batch).
//! - Order: the ops of a batch, and of different batches, may be in flight together and
//!   complete in any order, with one exception: a `Flush` starts only once every write
//!   before it in its batch has completed (io_uring: IOSQE_IO_DRAIN on the fsync, which
//!   waits for everything submitted on the ring before it and holds back what comes
//!   after it until it completes). A read that overlaps a write in flight may see either
//!   bytes; a caller that needs an order between batches waits for the first.
//! - Each op is checked on its own: offsets and lengths must be multiples of [`SECTOR`],
//!   buffer memory aligned to [`MEM_ALIGN`], the range inside the device, and a `Flush`
//!   carries no buffers. A bad op fails with its error ([`DevError::Misaligned`],
//!   [`DevError::OutOfRange`]) and the others run. A short transfer is an error
//!   ([`DevError::Short`]), never a partial success.
//!
//! Rules for a [`Pending`]:
//! - It is `Send`: any thread may wait for it, poll it or drop it, not only the one that
//!   started it. Completions are reaped by whichever thread waits: io_uring rings are per
//!   thread and device for submission, and a thread that waits for a batch on another
//!   thread's ring reaps that ring (one waiter sleeps in the kernel, the others on a
//!   condition variable; see `uring.rs`).
//! - Dropping it without waiting (also while unwinding from a panic) waits for its ops
//!   before their buffers are freed: the kernel never writes into freed memory. The
//!   results are thrown away; a dropped write still reaches the medium. Leaking it
//!   (`mem::forget`) leaks its buffers: the ring keeps them until it reaps the ops.
//! - The thread that started a batch should outlive its ops: when a thread exits, the
//!   kernel may cancel requests it submitted that have not started yet (queued for its
//!   io_uring workers), and those ops fail with ECANCELED. Memory stays safe: the batch
//!   still waits for every op.
//! - Engines without a queue (psync, mem) do the I/O inside `start` and return a
//!   finished handle; sim does reads and writes inside `start` (flushes too, unless a
//!   test holds them) and finishes the handle after its latency. io_uring keeps at most
//!   `queue_depth` ops on a ring and the rest in user space; those go to the device as
//!   earlier ones complete, which is seen whenever a thread starts, polls or waits on that
//!   ring. A batch larger than the queue depth needs someone to poll or wait to finish.
//!
//! Engines and media. How requests are issued (the engine) is kept apart from where the
//! bytes live (the medium, `medium.rs`):
//! - [`uring::UringDevice`] on a [`FileMedium`] (image file or block device): io_uring,
//!   O_DIRECT, registered buffers, one ring per thread, a bounded queue.
//! - [`psync::PsyncDevice`] on a [`FileMedium`]: preadv/pwritev2/fdatasync, in order,
//!   inside `start`. The reference.
//! - [`mem::MemDevice`] on a [`MemoryMedium`]: loads and stores, inside `start`.
//! - [`sim::SimDevice`] on a [`MemoryMedium`]: loads and stores plus seeded faults,
//!   latency and a log of writes and flushes from which crash images are built.
//!
//! A pmem engine fits as loads and stores on a [`MemoryMedium`] backed by a mapping of a
//! DAX (or tmpfs) file, whose `persist` writes back cache lines (clwb, sfence) where the
//! heap-backed medium has nothing to do.
//!
//! Durability per engine (`Flush`; `WriteFua`):
//! - uring: IORING_OP_FSYNC with DATASYNC, IOSQE_IO_DRAIN if a write precedes it in its
//!   batch; the write with RWF_DSYNC in its rw_flags.
//! - psync: fdatasync; pwritev2 with RWF_DSYNC (pwritev + fdatasync where refused).
//! - mem: `MemoryMedium::persist` (nothing on the heap); the store, then `persist` of
//!   its range.
//! - sim: [`sim::LogEntry::Flush`], exactly as `flush()` always did; the write logged as
//!   [`sim::LogEntry::WriteFua`], which every crash image keeps.
//!
//! RWF_DSYNC is honoured on both media we run on: on an image file the file system
//! (ext4) sends the write with FUA where the disk has it and otherwise flushes the disk
//! cache after it (this virtio disk reports `queue/fua` 0 and a write-back cache: write
//! then flush); on a block device the block layer does the same for REQ_FUA.
//!
//! All engines pass the one conformance suite in `tests.rs`.

mod buf;
pub mod gate;
pub mod medium;
pub mod mem;
pub mod overlay;
pub mod psync;
pub mod sim;
#[cfg(test)]
mod tests;
pub mod uring;

pub use buf::{AlignedBuf, Arena, MEM_ALIGN};
pub use medium::{FileMedium, MemoryMedium};

use std::fmt;

/// The unit of alignment for offsets and lengths.
pub const SECTOR: u64 = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
    /// A write that is durable once it completes (FUA). It makes no other write durable.
    WriteFua,
    /// Make durable every write that completed before the batch was started and every
    /// write before this op in its batch; it starts only once the writes before it in
    /// its batch have completed. Carries no buffers; the offset is ignored.
    Flush,
}

impl OpKind {
    /// Whether the op moves bytes to the medium.
    pub fn is_write(self) -> bool {
        matches!(self, OpKind::Write | OpKind::WriteFua)
    }
}

/// One request: read into or write from `bufs`, laid end to end from `offset`.
#[derive(Debug)]
pub struct Op {
    pub kind: OpKind,
    pub offset: u64,
    pub bufs: Vec<AlignedBuf>,
}

impl Op {
    pub fn read(offset: u64, buf: AlignedBuf) -> Op {
        Op { kind: OpKind::Read, offset, bufs: vec![buf] }
    }
    pub fn write(offset: u64, buf: AlignedBuf) -> Op {
        Op { kind: OpKind::Write, offset, bufs: vec![buf] }
    }
    pub fn write_fua(offset: u64, buf: AlignedBuf) -> Op {
        Op { kind: OpKind::WriteFua, offset, bufs: vec![buf] }
    }
    pub fn flush() -> Op {
        Op { kind: OpKind::Flush, offset: 0, bufs: Vec::new() }
    }
    pub fn len(&self) -> u64 {
        self.bufs.iter().map(|b| b.len() as u64).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A finished request: its buffers, handed back, and its result.
#[derive(Debug)]
pub struct Done {
    pub bufs: Vec<AlignedBuf>,
    pub result: Result<(), DevError>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DevError {
    /// The OS (or the simulated medium) failed the request with this errno.
    Io(i32),
    /// Fewer bytes moved than asked for.
    Short { expected: u64, got: u64 },
    /// Offset, length or buffer memory not aligned (or a flush that carries buffers).
    Misaligned,
    /// The request runs past the end of the device.
    OutOfRange,
}

impl fmt::Display for DevError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevError::Io(e) => write!(f, "I/O error: {}", std::io::Error::from_raw_os_error(*e)),
            DevError::Short { expected, got } => {
                write!(f, "short transfer: {got} of {expected} bytes")
            }
            DevError::Misaligned => write!(f, "misaligned request"),
            DevError::OutOfRange => write!(f, "request past the end of the device"),
        }
    }
}

impl std::error::Error for DevError {}

/// The completion handle of a started batch (see the module doc for the rules).
#[must_use = "dropping a Pending waits for its ops and throws their results away"]
pub struct Pending {
    state: PendingState,
}

enum PendingState {
    Finished(Vec<Done>),
    Running(Box<dyn Completion>),
}

/// An engine's side of a [`Pending`] whose ops may still be in flight.
///
/// Dropping it before `wait` must not free a buffer the device may still touch: it
/// waits for the ops, or leaves the buffers with something that outlives them.
pub trait Completion: Send {
    /// Make progress without blocking; true once every op has completed.
    fn poll(&mut self) -> bool;
    /// Block until every op has completed; one `Done` per op, in op order. Called once.
    fn wait(&mut self) -> Vec<Done>;
}

impl Pending {
    /// A handle whose ops have all completed (engines that work inside `start`).
    pub fn ready(done: Vec<Done>) -> Pending {
        Pending { state: PendingState::Finished(done) }
    }

    /// Run every op now with `run` (engines without a queue: psync, mem) and hand back
    /// a finished handle.
    pub fn run_each(ops: Vec<Op>, mut run: impl FnMut(&mut Op) -> Result<(), DevError>) -> Pending {
        Pending::ready(
            ops.into_iter()
                .map(|mut op| {
                    let result = run(&mut op);
                    Done { bufs: op.bufs, result }
                })
                .collect(),
        )
    }

    /// A handle for ops an engine has in flight.
    pub fn new(running: Box<dyn Completion>) -> Pending {
        Pending { state: PendingState::Running(running) }
    }

    /// Whether every op has completed; never blocks (it may reap completions).
    pub fn is_done(&mut self) -> bool {
        match &mut self.state {
            PendingState::Finished(_) => true,
            PendingState::Running(c) => c.poll(),
        }
    }

    /// The results if every op has completed, the handle back otherwise; never blocks.
    pub fn try_done(mut self) -> Result<Vec<Done>, Pending> {
        if self.is_done() {
            Ok(self.wait())
        } else {
            Err(self)
        }
    }

    /// Block until every op has completed; one `Done` per op, in op order.
    pub fn wait(self) -> Vec<Done> {
        match self.state {
            PendingState::Finished(done) => done,
            PendingState::Running(mut c) => c.wait(),
        }
    }
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            PendingState::Finished(done) => write!(f, "Pending(finished, {} ops)", done.len()),
            PendingState::Running(_) => write!(f, "Pending(running)"),
        }
    }
}

pub trait Device: Send + Sync {
    /// Size of the device in bytes (a multiple of SECTOR).
    fn len(&self) -> u64;

    /// Put a batch of requests on the device and return without waiting for them. They
    /// may be in flight together and complete in any order, except that a `Flush` waits
    /// for the writes before it in the batch.
    fn start(&self, ops: Vec<Op>) -> Pending;

    /// Run a batch of requests and wait for them: `start(ops).wait()`. The result has
    /// one `Done` per op, in the order of `ops`.
    fn submit(&self, ops: Vec<Op>) -> Vec<Done> {
        self.start(ops).wait()
    }

    /// Run the batches `next` produces as one stream: an engine that can keep
    /// requests in flight asks for the next batch while earlier ones are on the
    /// device, so the caller's work to build a batch overlaps the I/O. One `Done` per
    /// op, in the order the ops were produced.
    fn submit_stream(&self, next: &mut dyn FnMut() -> Option<Vec<Op>>) -> Vec<Done> {
        let mut out = Vec::new();
        while let Some(ops) = next() {
            out.extend(self.submit(ops));
        }
        out
    }

    /// Make every completed write durable: a batch of one `Flush`.
    fn flush(&self) -> Result<(), DevError> {
        let mut done = self.submit(vec![Op::flush()]);
        done.pop().expect("one op, one completion").result
    }

    /// A buffer suitable for this device (engines with registered memory override
    /// it). Its contents are unspecified: use it for data that overwrites it whole.
    fn alloc(&self, len: usize) -> AlignedBuf {
        AlignedBuf::new(len)
    }

    /// A buffer of zeros.
    fn alloc_zeroed(&self, len: usize) -> AlignedBuf {
        let mut b = self.alloc(len);
        b.fill(0);
        b
    }

    /// A short name for reports ("uring", "psync", ...).
    fn name(&self) -> &'static str;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self, offset: u64, buf: AlignedBuf) -> (AlignedBuf, Result<(), DevError>) {
        one(self.submit(vec![Op::read(offset, buf)]))
    }

    fn write(&self, offset: u64, buf: AlignedBuf) -> (AlignedBuf, Result<(), DevError>) {
        one(self.submit(vec![Op::write(offset, buf)]))
    }
}

fn one(mut done: Vec<Done>) -> (AlignedBuf, Result<(), DevError>) {
    let d = done.pop().expect("one op, one completion");
    let mut bufs = d.bufs;
    (bufs.pop().expect("one buffer"), d.result)
}

/// The checks every engine makes before it touches the medium.
pub fn validate(op: &Op, dev_len: u64) -> Result<(), DevError> {
    if op.kind == OpKind::Flush {
        return if op.bufs.is_empty() { Ok(()) } else { Err(DevError::Misaligned) };
    }
    if !op.offset.is_multiple_of(SECTOR) || op.bufs.is_empty() {
        return Err(DevError::Misaligned);
    }
    for b in &op.bufs {
        if !(b.len() as u64).is_multiple_of(SECTOR) || b.is_empty() || !(b.as_ptr() as usize).is_multiple_of(MEM_ALIGN)
        {
            return Err(DevError::Misaligned);
        }
    }
    match op.offset.checked_add(op.len()) {
        Some(end) if end <= dev_len => Ok(()),
        _ => Err(DevError::OutOfRange),
    }
}

/// The result of a read or write that moved `n` bytes (negative: an errno) of `expected`.
pub(crate) fn transferred(n: i64, expected: u64) -> Result<(), DevError> {
    if n < 0 {
        return Err(DevError::Io(-n as i32));
    }
    if n as u64 != expected {
        return Err(DevError::Short { expected, got: n as u64 });
    }
    Ok(())
}
