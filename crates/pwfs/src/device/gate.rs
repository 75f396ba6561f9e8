//! gate: a device that can be cut off, as by a power cut (`Fs::go_down`).
//!
//! Interface: [`Gate::new`] wraps a device and passes everything through until
//! [`Gate::close`]; from then on every op of every batch started fails with EIO and
//! never reaches the medium (reads too: a file system that was shut down returns EIO
//! for everything, as XFS does). Batches started before `close` run to completion. A
//! mount puts one in front of its device, so that a shutdown needs no cooperation from
//! the code paths that write.

use super::{AlignedBuf, Device, Done, Op, Pending};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub struct Gate {
    inner: Arc<dyn Device>,
    /// Set once, never cleared: a closed gate stays closed for the mount's life.
    closed: AtomicBool,
    /// Requests passed on: writes (FUA writes included), FUA writes, flushes, and
    /// bytes written.
    counts: [AtomicU64; 4],
}

impl Gate {
    pub fn new(inner: Arc<dyn Device>) -> Gate {
        Gate { inner, closed: AtomicBool::new(false), counts: Default::default() }
    }

    /// Refuse every later op.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Requests passed to the device so far.
    pub fn counters(&self) -> DeviceCounters {
        let l = |i: usize| self.counts[i].load(Ordering::Relaxed);
        DeviceCounters { writes: l(0), fua_writes: l(1), flushes: l(2), bytes_written: l(3) }
    }

    fn count(&self, ops: &[Op]) {
        for op in ops {
            let i = match op.kind {
                super::OpKind::Write => 0,
                super::OpKind::WriteFua => 1,
                super::OpKind::Flush => 2,
                super::OpKind::Read => continue,
            };
            if i < 2 {
                self.counts[0].fetch_add(1, Ordering::Relaxed);
                self.counts[3].fetch_add(op.len(), Ordering::Relaxed);
            }
            if i > 0 {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn refuse(ops: Vec<Op>) -> Vec<Done> {
        ops.into_iter().map(|op| Done { bufs: op.bufs, result: Err(super::DevError::Io(libc::EIO)) }).collect()
    }
}

/// What a mount asked of its device (`Fs::device_counters`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Write requests, FUA writes included.
    pub writes: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub bytes_written: u64,
}

impl Device for Gate {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn start(&self, ops: Vec<Op>) -> Pending {
        if self.is_closed() {
            return Pending::ready(Gate::refuse(ops));
        }
        self.count(&ops);
        self.inner.start(ops)
    }

    fn submit_stream(&self, next: &mut dyn FnMut() -> Option<Vec<Op>>) -> Vec<Done> {
        // Each batch is checked as it is produced: after a close in the middle of a
        // stream, what follows is refused (the inner device sees an empty batch). The
        // results are put back in the order the ops were produced.
        let mut batches: Vec<Result<usize, Vec<Done>>> = Vec::new();
        let mut gated = || match next() {
            Some(ops) if self.is_closed() => {
                batches.push(Err(Gate::refuse(ops)));
                Some(Vec::new())
            }
            Some(ops) => {
                self.count(&ops);
                batches.push(Ok(ops.len()));
                Some(ops)
            }
            None => None,
        };
        let passed = self.inner.submit_stream(&mut gated);
        let mut passed = passed.into_iter();
        let mut done = Vec::new();
        for b in batches {
            match b {
                Ok(n) => done.extend(passed.by_ref().take(n)),
                Err(refused) => done.extend(refused),
            }
        }
        done
    }

    fn alloc(&self, len: usize) -> AlignedBuf {
        self.inner.alloc(len)
    }

    fn alloc_zeroed(&self, len: usize) -> AlignedBuf {
        self.inner.alloc_zeroed(len)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}
