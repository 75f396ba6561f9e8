//! device: where bytes live.
//!
//! Interface: a [`Device`] takes a batch of [`Op`]s, each owning its [`AlignedBuf`]s,
//! and gives every buffer back in a [`Done`] with the op's result, even on error.
//! Offsets and lengths must be multiples of [`SECTOR`]; buffer memory is aligned to
//! [`MEM_ALIGN`]. A short transfer is an error ([`DevError::Short`]), never a partial
//! success. `flush` makes every write that completed before it durable.
//!
//! Engines: [`uring::UringDevice`] (io_uring, O_DIRECT, fixed buffers, one ring per
//! thread), [`psync::PsyncDevice`] (pread/pwrite, the reference), [`mem::MemDevice`]
//! and [`sim::SimDevice`] (seeded faults, latency, crash images). All of them pass the
//! one conformance suite in `tests.rs`.

mod buf;
pub mod mem;
pub mod psync;
pub mod sim;
#[cfg(test)]
mod tests;
pub mod uring;

pub use buf::{AlignedBuf, Arena, MEM_ALIGN};

use std::fmt;

/// The unit of alignment for offsets and lengths.
pub const SECTOR: u64 = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
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
    /// Offset, length or buffer memory not aligned.
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

pub trait Device: Send + Sync {
    /// Size of the device in bytes (a multiple of SECTOR).
    fn len(&self) -> u64;

    /// Run a batch of requests; they may be in flight together and complete in any
    /// order. The result has one `Done` per op, in the order of `ops`.
    fn submit(&self, ops: Vec<Op>) -> Vec<Done>;

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

    /// Make every completed write durable.
    fn flush(&self) -> Result<(), DevError>;

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
