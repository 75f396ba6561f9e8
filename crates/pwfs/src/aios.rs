//! aios: the asynchronous I/O stack (mechanism 4, DESIGN.md §1.4; Lee et al., ATC'19).
//! The device works while the stack does its bookkeeping, instead of after it.
//!
//! - Read miss ([`FsInner::read_pages_start`]): the pages not in the cache are mapped
//!   from the inode's in-memory block map, their reads are put on the device, and only
//!   then are their cache entries made; the buffers come from the device's registered
//!   arena (the pool). Two threads missing on one page may both read it: the one whose
//!   entry lost discards its copy. An entry is not readable until its read completes,
//!   and a failed read wakes its waiters with the error. The reader waits for its
//!   reads without the file's lock (`Fs::read_pages`): a writer of the file does not
//!   wait for the device on a reader's behalf.
//! - Commit ([`FsInner::commit_overlapped`]): data writes are put on the device; without
//!   waiting, the transaction's descriptor and images are built and put on the device;
//!   the commit block is built while both are in flight; then the stack waits for data
//!   and journal, flushes, and writes the commit block with FUA (write + flush where the
//!   device has no FUA). The order on the medium is the classic one (`journal.rs`).
//! - Completion: hybrid polling lives in the io_uring engine (`UringOptions::poll`):
//!   a waiter spins on the completion queue for a calibrated time before it sleeps.
//!
//! The off-switch is `Stack::Sync` (`Config::stack`): every step waits for the one
//! before it. Where the time of a read miss and of an fsync goes (software before the
//! first submission, device, software after the last completion) is measured when
//! `Config::trace_io` is on ([`IoTimes`]).

use crate::cache::Page;
use crate::error::Result;
use crate::format::BLOCK_SIZE;
use crate::fs::inode::InodeCell;
use crate::fs::FsInner;
use crate::nbw::{StartedFetch, DISCARD};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Where the time of one kind of request went, summed over the requests traced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathTimes {
    /// Requests traced (those that reached the device on the calling thread).
    pub count: u64,
    /// From entry to the first submission: software before the device.
    pub before_ns: u64,
    /// From the first submission to the last completion seen.
    pub device_ns: u64,
    /// From the last completion to the return: software after the device.
    pub after_ns: u64,
}

/// Time breakdowns of read misses and fsyncs (`Config::trace_io`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoTimes {
    pub reads: PathTimes,
    pub fsyncs: PathTimes,
}

#[derive(Default)]
pub(crate) struct PathCounters {
    count: AtomicU64,
    before: AtomicU64,
    device: AtomicU64,
    after: AtomicU64,
}

impl PathCounters {
    fn get(&self) -> PathTimes {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PathTimes {
            count: l(&self.count),
            before_ns: l(&self.before),
            device_ns: l(&self.device),
            after_ns: l(&self.after),
        }
    }
}

#[derive(Default)]
pub(crate) struct Times {
    pub reads: PathCounters,
    pub fsyncs: PathCounters,
}

impl Times {
    pub fn get(&self) -> IoTimes {
        IoTimes { reads: self.reads.get(), fsyncs: self.fsyncs.get() }
    }
}

/// Whether any mounted file system traces (one flag for the process: a mark costs a
/// load of it when off).
static TRACING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The calling thread's first submission and last completion since `Trace::begin`.
    static MARKS: Cell<(Option<Instant>, Option<Instant>)> = const { Cell::new((None, None)) };
}

pub(crate) fn enable_tracing() {
    TRACING.store(true, Ordering::Relaxed);
}

/// The calling thread is about to put requests on the device.
pub(crate) fn submitting() {
    if TRACING.load(Ordering::Relaxed) {
        MARKS.with(|m| {
            let (s, c) = m.get();
            if s.is_none() {
                m.set((Some(Instant::now()), c));
            }
        });
    }
}

/// The calling thread has seen requests complete.
pub(crate) fn completed() {
    if TRACING.load(Ordering::Relaxed) {
        MARKS.with(|m| m.set((m.get().0, Some(Instant::now()))));
    }
}

/// One traced request on the calling thread: begun at entry, ended at return.
pub(crate) struct Trace(Option<Instant>);

impl Trace {
    pub fn begin(on: bool) -> Trace {
        if !on {
            return Trace(None);
        }
        MARKS.with(|m| m.set((None, None)));
        Trace(Some(Instant::now()))
    }

    /// Count the request in `into` if it reached the device on this thread.
    pub fn end(self, into: &PathCounters) {
        let Some(t0) = self.0 else { return };
        let (Some(s), Some(c)) = MARKS.with(|m| m.get()) else { return };
        let end = Instant::now();
        let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as u64;
        into.count.fetch_add(1, Ordering::Relaxed);
        into.before.fetch_add(ns(t0, s), Ordering::Relaxed);
        into.device.fetch_add(ns(s, c), Ordering::Relaxed);
        into.after.fetch_add(ns(c, end), Ordering::Relaxed);
    }
}

impl FsInner {
    /// Pages `first..first + n` of a regular file for a read (the asynchronous
    /// stack's miss path): cached pages as they are; the others put on the device,
    /// their requests submitted before their cache entries are made, and returned
    /// with the fetch to finish (`finish_fetch`, which makes them readable or failed).
    /// The caller holds the file's I/O lock shared, so no write moves a block of the
    /// range meanwhile, and has noted the range's end (`note_pages`) for truncates; it
    /// may finish the fetch after letting go of the lock: the pages are in the cache,
    /// where a truncate finds them and waits for them (as for readahead). Pages it
    /// found, or lost a race for, may still be in another thread's fetch or write-back
    /// (the caller waits on each page, as on the synchronous path).
    pub(crate) fn read_pages_start(
        &self,
        cell: &InodeCell,
        first: u64,
        n: u64,
    ) -> Result<(Vec<Arc<Page>>, Option<StartedFetch>)> {
        let ino = cell.ino;
        let mut found = self.cache.lookup_range(ino, first, n);
        let missing: Vec<u64> = (0..n).filter(|i| found[*i as usize].is_none()).map(|i| first + i).collect();
        if missing.is_empty() {
            return Ok((found.into_iter().map(|p| p.expect("found")).collect(), None));
        }
        // The block map is the inode's, in memory: no metadata I/O before submission.
        let maps: Vec<Option<u64>> = {
            let node = cell.lock();
            missing.iter().map(|i| if node.freed { None } else { node.map_data(*i) }).collect()
        };
        // One request per run of consecutive blocks; buffers from the registered pool.
        let (ops, runs) = self.read_requests(&maps);
        let pending = (!ops.is_empty()).then(|| self.start_reads(ops));
        // While the device reads: the cache entries. A page someone else put in the
        // cache meanwhile is theirs (its read, its patches); ours is discarded.
        let mut won: Vec<Arc<Page>> = Vec::new();
        let mut slot = vec![DISCARD; missing.len()];
        for (k, idx) in missing.iter().enumerate() {
            let (p, new) = self.cache.get_or_insert((ino, *idx));
            if new {
                if maps[k].is_none() {
                    // A hole (or a page past a freed inode's end): zeros, no device.
                    let g = p.lock();
                    self.settle_patches(g.patch_bytes());
                    p.complete(g, self.dev.alloc_zeroed(BLOCK_SIZE));
                } else {
                    slot[k] = won.len();
                    won.push(p.clone());
                }
            }
            found[(*idx - first) as usize] = Some(p);
        }
        let started = pending.map(|pending| {
            let owners = runs.into_iter().map(|run| run.into_iter().map(|k| slot[k]).collect()).collect();
            StartedFetch { ino, pages: won, owners, pending }
        });
        Ok((found.into_iter().map(|p| p.expect("every page found or inserted")).collect(), started))
    }

    /// The asynchronous stack's commit of the running transaction (see the module
    /// doc), writing the dirty data `writeback_selection(files)` picks (all of it for
    /// None). The caller holds the commit lock.
    pub(crate) fn commit_overlapped(&self, files: Option<&std::collections::BTreeSet<u64>>) -> Result<()> {
        let (wb, taken) = self.take_for_commit(files)?;
        let (tx, frees) = match taken {
            Ok(v) => v,
            Err(e) => {
                self.end_quietly(wb);
                return Err(self.poison(e));
            }
        };
        let logged: Vec<u64> = tx.images.iter().map(|(b, _)| *b).collect();
        let logged_data = tx.logged_data();
        if tx.is_empty() {
            if let Some(wb) = wb {
                self.writeback_end(wb)?;
            }
            // Data written by this write-back or an earlier one not followed by a
            // flush (the write-back thread, an fdatasync's).
            if self.take_unflushed() {
                submitting();
                self.dev.flush().map_err(|e| self.poison(e.into()))?;
                completed();
            }
            self.meta.lock().alloc.release(frees);
            return Ok(());
        }
        if let Err(e) = self.clean.before_change(&*self.dev, &self.sb) {
            self.end_quietly(wb);
            return Err(self.poison(e));
        }
        let mut j = self.journal.lock();
        let before = j.stats.checkpoints;
        submitting();
        // A checkpoint first (the log is full): it must not run while this commit's
        // data writes are in flight (its flush would not cover them, and a carried
        // block retired by this commit must be on the medium before the log that held
        // it is emptied). Rare: the data is waited for here instead of beside the body.
        let mut wb = wb;
        if j.needs_checkpoint(&tx) {
            if let Some(w) = wb.take() {
                if let Err(e) = self.writeback_end(w) {
                    return Err(self.poison(e));
                }
            }
        }
        let started = match j.start(&*self.dev, tx) {
            Ok(s) => s,
            Err(e) => {
                self.end_quietly(wb);
                return Err(self.poison(e));
            }
        };
        let data = || {
            let r = match wb {
                Some(wb) => self.writeback_end(wb),
                None => Ok(()),
            };
            // The flush `finish` makes next covers every data write so far.
            let unflushed = self.take_unflushed();
            r.map(|()| unflushed)
        };
        j.finish(&*self.dev, started, data).map_err(|e| self.poison(e))?;
        completed();
        let checkpointed = j.stats.checkpoints != before;
        drop(j);
        self.committed(logged, &logged_data, frees, checkpointed);
        Ok(())
    }

    /// End a write-back on an error path: its pages get their buffers back; its own
    /// error, if any, is already the file system's.
    fn end_quietly(&self, wb: Option<crate::writeback::StartedWriteback>) {
        if let Some(wb) = wb {
            let _ = self.writeback_end(wb);
        }
    }
}
