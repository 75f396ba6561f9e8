//! commit: the running transaction — admitting operations while it has room, closing it
//! (write back data first: ordered mode), logging it, freeing unlinked inodes as it goes.

use crate::error::{Error, Result};
use crate::fs::inode::InodeCell;
use crate::fs::meta::{Meta, TxSize};
use crate::fs::tx::Credit;
use crate::fs::FsInner;
use std::sync::atomic::Ordering;

/// What an operation adds to the running transaction at most, and the free blocks
/// (and inode) it takes.
pub(crate) struct Need {
    pub tx: TxSize,
    pub blocks: u64,
    pub inode: bool,
    /// It may split extents without freeing any block (zero range, insert range):
    /// the commit may then grow the file's extent chain, from the reserve
    /// (`meta_reserve`), which it must find there. (A write into fallocated blocks
    /// splits too, but is not refused: fallocate promised it room.)
    pub splits: bool,
}

impl Need {
    /// A change that adds `tx` to the transaction, takes `blocks` new blocks and
    /// (`inode`) a new inode, and splits no extent.
    pub fn new(tx: TxSize, blocks: u64, inode: bool) -> Need {
        Need { tx, blocks, inode, splits: false }
    }

    pub fn tx(tx: TxSize) -> Need {
        Need::new(tx, 0, false)
    }
}

/// A directory entry added or changed: its block, and when the directory grows, a new
/// block and the bitmap block that allocates it.
pub(crate) fn entry_cost(grow: bool) -> TxSize {
    TxSize::new(1 + 2 * grow as u64, 0)
}

impl FsInner {
    /// Free an inode that lost its last name and handle, now, in the running
    /// transaction (as ext4 does at the last iput), so that its number and blocks are
    /// reused soon and commits do not gather the work of many deletes. The caller
    /// holds no lock. An inode too big for a share of the journal, or one reopened or
    /// relinked meanwhile, is left to the commit (`free_unlinked`), which frees it in
    /// pieces, or not at all.
    pub(crate) fn free_now(&self, cell: &InodeCell) -> Result<()> {
        let ino = cell.ino;
        // Checked again under the inode's lock before the mark: `open_cell` counts a
        // handle only of an inode not freed, so one of the two wins.
        let gone = || {
            let g = cell.lock();
            cell.opens.load(Ordering::Acquire) == 0 && !g.freed && g.d.nlink == 0
        };
        if !gone() {
            return Ok(());
        }
        // No reader inside the file: its pages are dropped for good. Whoever frees an
        // inode marks it under this lock: checked again once it is held, since the
        // number may belong to a new file by now, whose pages are not to be dropped.
        let _io = cell.io.write();
        if !gone() {
            return Ok(());
        }
        let dropped = self.cache.drop_from(ino, 0, cell.pages_end());
        self.forget_pages(dropped);
        let share = self.tx_room() / 4;
        let (mut m, free) = self.admitted(|m| {
            if !gone() {
                return Ok((Need::tx(TxSize::default()), false));
            }
            let cost = m.free_cost(ino)?;
            if cost.log_blocks() > share {
                return Ok((Need::tx(TxSize::default()), false));
            }
            Ok((Need::tx(cost), true))
        })?;
        if !free {
            return Ok(());
        }
        self.mutate(&mut m, |m| {
            {
                let mut g = cell.lock();
                if cell.opens.load(Ordering::Acquire) != 0 || g.freed || g.d.nlink != 0 {
                    return Ok(());
                }
                g.freed = true;
            }
            m.to_free.remove(&ino);
            self.free_inode(m, ino)
        })
    }

    /// `Meta::free_inode`, and a loss recorded for the number (`fetch_errors`) goes
    /// with it: the next inode of that number must not report it.
    pub(crate) fn free_inode(&self, m: &mut Meta, ino: u64) -> Result<()> {
        m.free_inode(ino)?;
        // Its lock only if a loss was ever recorded (set before the loss, under that
        // lock, and the inode's pages were settled before it is freed).
        if self.any_lost.load(std::sync::atomic::Ordering::Acquire) {
            self.fetch_errors.lock().remove(&ino);
        }
        Ok(())
    }

    /// Free the inodes that lost their last name and handle, as many as fit in the
    /// running transaction; returns whether some are left for another one. Under the
    /// commit lock, so that write-back never places a page of a freed inode.
    fn free_unlinked(&self) -> Result<bool> {
        // Reopened by inode number, or relinked, meanwhile: it stays.
        let unlinked = |m: &mut Meta, ino: u64| -> Result<bool> {
            // Freed already (listed twice): nothing to do.
            let Ok(cell) = m.cell(ino) else { return Ok(false) };
            let opens = cell.opens.load(std::sync::atomic::Ordering::Acquire);
            Ok(opens == 0 && cell.lock().d.nlink == 0)
        };
        let inos: Vec<u64> = self.meta.lock().to_free.iter().copied().collect();
        let mut busy = Vec::new();
        for ino in inos {
            let cell = {
                let mut m = self.meta.lock();
                m.to_free.remove(&ino);
                if !unlinked(&mut m, ino)? {
                    continue;
                }
                m.cell(ino)?
            };
            // No reader is inside the file (readahead queued before the last handle
            // went may still come): else its pages could enter the cache after they
            // are dropped, and outlive the inode into the next one of that number.
            // The lock is taken after the commit lock, against the lock order, so
            // only if it is free at once; a busy inode waits for the next commit.
            let Some(_io) = cell.io.try_write() else {
                busy.push(ino);
                continue;
            };
            // This cell, checked again now that its lock is held (`free_now` may have
            // freed it meanwhile, and a new file taken the number: its pages stay).
            let still = || {
                let g = cell.lock();
                !g.freed && g.d.nlink == 0 && cell.opens.load(std::sync::atomic::Ordering::Acquire) == 0
            };
            if !still() {
                continue;
            }
            // Without the metadata lock: a page being fetched is waited for.
            let dropped = self.cache.drop_from(ino, 0, cell.pages_end());
            self.forget_pages(dropped);
            let mut m = self.meta.lock();
            if !still() {
                continue;
            }
            let cost = m.free_cost(ino)?;
            if m.tx_size().plus(cost).log_blocks() > self.tx_room() {
                // Too big for what is left of this transaction: freed in the next
                // one, or, if it is too big for any, a part of it in each.
                let empty = m.tx_is_empty();
                let trimmed = empty && m.trim_inode(ino, self.tx_room())?;
                m.to_free.insert(ino);
                m.to_free.extend(busy);
                if empty && !trimmed {
                    if m.tx.credits() != TxSize::default() {
                        // Room promised to operations in progress: a later commit.
                        return Ok(false);
                    }
                    return Err(Error::corrupt(format!("bug: inode {ino} cannot be freed within the journal")));
                }
                return Ok(true);
            }
            // The last check and the mark are made under the inode's lock, under which
            // `open_ino` counts a handle only of an inode not freed: one of the two wins.
            {
                let mut g = cell.lock();
                if cell.opens.load(std::sync::atomic::Ordering::Acquire) != 0 || g.d.nlink != 0 {
                    continue;
                }
                g.freed = true;
            }
            self.free_inode(&mut m, ino)?;
        }
        self.meta.lock().to_free.extend(busy);
        Ok(false)
    }

    /// Unlinked inodes found at mount (their last handle went away in a crash) are
    /// freed by the first commit.
    pub(crate) fn free_orphans(&self) -> Result<usize> {
        let mut m = self.meta.lock();
        let mut n = 0;
        for ino in m.used_inodes() {
            if m.inode(ino)?.d.nlink == 0 {
                m.to_free.insert(ino);
                n += 1;
            }
        }
        Ok(n)
    }

    pub fn commit(&self) -> Result<()> {
        self.check_alive()?;
        let _c = self.commit_lock.lock();
        self.commit_locked()
    }

    /// Write back data, then log metadata. The caller holds the commit lock. Freeing
    /// unlinked inodes may take several transactions.
    pub fn commit_locked(&self) -> Result<()> {
        self.commit_locked_for(None)
    }

    /// `commit_locked`, or for an fsync of `file`: the whole running transaction, but
    /// only the data `writeback_locked_for` picks for `file` and for the files of the
    /// fsyncs waiting meanwhile (`fsync_ticket`): they share this commit (group
    /// commit), and it covers them.
    pub(crate) fn commit_locked_for(&self, file: Option<u64>) -> Result<()> {
        // A commit that panics half way leaves a transaction half closed.
        let _unwinding = PoisonOnUnwind::new(self);
        // Numbered first, then the waiting files taken: an fsync that registered its
        // file after the take got a ticket past this commit (see `fsync_ticket`).
        let n = self.commits_begun.fetch_add(1, Ordering::AcqRel) + 1;
        let waiting = std::mem::take(&mut *self.fsync_files.lock());
        let files = file.map(|f| {
            let mut files = waiting;
            files.insert(f);
            files
        });
        // Bounded: what is left to free waits for the next commit rather than keep a
        // caller here (an inode trimmed a piece per transaction, say, while writers keep
        // the transaction from ever being empty).
        for _ in 0..64 {
            self.check_alive()?;
            let more = self.free_unlinked().map_err(|e| self.poison(e))?;
            self.commit_once(files.as_ref())?;
            if !more {
                break;
            }
        }
        self.commits_done.store(n, Ordering::Release);
        Ok(())
    }

    /// A ticket for `covered`, for an fsync of `file`: the file is registered first,
    /// so that every commit numbered at or past the ticket writes its data.
    pub fn fsync_ticket(&self, file: u64) -> u64 {
        self.fsync_files.lock().insert(file);
        self.commit_ticket()
    }

    /// A ticket for `covered`: taken before waiting for the commit lock.
    pub fn commit_ticket(&self) -> u64 {
        self.commits_begun.load(Ordering::Acquire) + 1
    }

    /// Whether a commit that began after `ticket` was taken has completed: everything
    /// done before the ticket (data written back, metadata logged) is durable. The
    /// caller holds the commit lock. fsyncs that arrive while a commit runs wait for
    /// it and then share one more (group commit), instead of one commit each.
    pub fn covered(&self, ticket: u64) -> bool {
        self.commits_done.load(Ordering::Acquire) >= ticket
    }

    /// The commit an fsync of `file` needs, unless a commit that began after this
    /// call finished while it waited.
    pub fn commit_shared(&self, file: u64) -> Result<()> {
        self.check_alive()?;
        let ticket = self.fsync_ticket(file);
        let _c = self.commit_lock.lock();
        if self.covered(ticket) {
            return self.check_alive();
        }
        self.commit_locked_for(Some(file))
    }

    /// The first step of a commit on either stack: the data chosen (`files`' and what
    /// the commit needs), its writes started, and the running transaction taken. From
    /// the choice of data to the closing of the transaction no write grows a file
    /// (`size_gate`): every size stored has its data written before it. The gate covers
    /// CPU work only: what needed a fetch is settled before it, and the data writes are
    /// waited for by the caller, before anything of the journal is written (Sync) or
    /// before the journal's flush (Async).
    #[allow(clippy::type_complexity)]
    pub(crate) fn take_for_commit(
        &self,
        files: Option<&std::collections::BTreeSet<u64>>,
    ) -> Result<(Option<crate::writeback::StartedWriteback>, Result<(crate::journal::Transaction, Vec<(u64, u64)>)>)>
    {
        self.settle_for_commit(files);
        let gate = self.size_gate.write();
        let selection = self.writeback_selection(files);
        let wb = self.writeback_begin(true, selection.as_ref(), crate::writeback::Wb::Commit(files))?;
        // The data blocks the journal carries (hitchhiking), and those it stops
        // carrying (written home whole by this write-back), taken with the transaction
        // under one hold of the metadata lock: a block freed after that (a truncate
        // does not wait for commits) is revoked by the next transaction, and its
        // record stays in this one, whose metadata still maps it.
        let (taken, (data, retired)) = {
            let mut m = self.meta.lock();
            // A change that failed or panicked half made poisons before the metadata
            // lock is let go: a commit that passed its first check before must not
            // take it.
            let taken = match self.is_poisoned.load(Ordering::Acquire) {
                true => Err(Error::io("file system is read-only after an error: nothing more is committed")),
                false => m.take_tx(selection.as_ref()),
            };
            (taken, self.hitch.take_staged(files.is_some()))
        };
        drop(gate);
        let taken = taken.map(|(mut tx, frees)| {
            tx.data = data;
            tx.retired = retired;
            (tx, frees)
        });
        Ok((wb, taken))
    }

    fn commit_once(&self, files: Option<&std::collections::BTreeSet<u64>>) -> Result<()> {
        if self.config.stack == crate::config::Stack::Async {
            return self.commit_overlapped(files);
        }
        let (wb, taken) = self.take_for_commit(files)?;
        if let Some(wb) = wb {
            self.writeback_end(wb)?;
        }
        let (tx, frees) = taken.map_err(|e| self.poison(e))?;
        let logged: Vec<u64> = tx.images.iter().map(|(b, _)| *b).collect();
        let data = tx.logged_data();
        // Every data write so far is covered by the flush below, or by the journal's.
        let unflushed = self.take_unflushed();
        if tx.is_empty() {
            if unflushed {
                crate::aios::submitting();
                self.dev.flush().map_err(|e| self.poison(e.into()))?;
                crate::aios::completed();
            }
            self.meta.lock().alloc.release(frees);
            return Ok(());
        }
        // The first change to reach the medium: the image is no longer clean.
        self.clean.before_change(&*self.dev, &self.sb).map_err(|e| self.poison(e))?;
        let mut j = self.journal.lock();
        let before = j.stats.checkpoints;
        crate::aios::submitting();
        j.commit_after(&*self.dev, tx, unflushed).map_err(|e| self.poison(e))?;
        crate::aios::completed();
        let checkpointed = j.stats.checkpoints != before;
        drop(j);
        self.committed(logged, &data, frees, checkpointed);
        Ok(())
    }

    /// A transaction is durable: its blocks' cached copies are the newest until a
    /// checkpoint writes them home (a checkpoint during it wrote the older ones), and
    /// the blocks it freed can be reused.
    /// `data`: the data blocks it carried (hitchhiking), with their new contents.
    pub(crate) fn committed(
        &self,
        logged: Vec<u64>,
        data: &[(u64, std::sync::Arc<crate::device::AlignedBuf>)],
        frees: Vec<(u64, u64)>,
        checkpointed: bool,
    ) {
        self.hitch.committed(data, checkpointed);
        let mut m = self.meta.lock();
        if checkpointed {
            m.pinned.clear();
        }
        m.pinned.extend(logged);
        m.alloc.release(frees);
    }

    /// Commit if the running transaction is getting too big for the journal, or if
    /// too much of the cache is dirty (the caller waits: write throttling). At half
    /// that much dirty data, wake the write-back thread instead, so that the device
    /// writes while the caller goes on filling the cache.
    pub fn maybe_commit(&self) {
        // The caller's change is made: an error here (a commit or write-back that
        // failed) has made the file system read-only, which every later change and
        // fsync reports; the call itself succeeded, as on Linux, where a write that
        // reached the page cache returns its count whatever write-back meets later.
        if let Err(e) = self.commit_if_due() {
            tracing::debug!("commit or write-back after a change failed: {e}");
        }
    }

    fn commit_if_due(&self) -> Result<()> {
        // A quarter of the journal: commits stay short, and the log holds several
        // before a checkpoint. (No lock is taken here: a commit in flight holds the
        // journal lock across its I/O.)
        let big = self.tx.estimate() >= (self.tx_cap / 4).max(4);
        if big {
            if self.config.writeback_interval.is_none() {
                return self.commit();
            }
            // The write-back thread commits while callers go on (as jbd2 does); a
            // caller waits for a commit only when the journal has no room left for
            // its change (`admitted`).
            if !self.commit_due.swap(true, Ordering::AcqRel) {
                self.wake.1.notify_all();
            }
        }
        let pressure = self.pressure();
        // Read first: a writer that finds the thread kicked already writes nothing
        // (the flag's line stays shared between the writers' CPUs).
        if pressure >= 0.5 && !self.kick.load(Ordering::Relaxed) && !self.kick.swap(true, Ordering::Relaxed) {
            self.wake.1.notify_all();
        }
        if pressure >= 1.0 {
            if self.config.writeback_interval.is_none() {
                return self.writeback();
            }
            // Throttle: wait for the write-back thread to bring dirty data under the
            // limit (so the device keeps writing while this writer waits), or do it
            // here if that takes too long.
            let mut g = self.throttle.0.lock();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
            while self.pressure() >= 1.0 {
                self.kick.store(true, Ordering::Relaxed);
                self.wake.1.notify_all();
                if self.throttle.1.wait_until(&mut g, deadline).timed_out() {
                    drop(g);
                    return self.writeback();
                }
            }
        }
        Ok(())
    }

    /// Run the changing part of an operation: the checks before it have passed, so an
    /// error now leaves a half-done change in memory, and the file system turns
    /// read-only rather than commit it.
    pub(crate) fn mutate<T>(&self, m: &mut Meta, f: impl FnOnce(&mut Meta) -> Result<T>) -> Result<T> {
        let _unwinding = PoisonOnUnwind::new(self);
        f(m).map_err(|e| self.poison(e))
    }

    /// Whether an operation that needs `need` may change things now: `Ok(true)` it
    /// may; `Ok(false)` the running transaction must commit first (the journal has no
    /// room for it, or committing frees space it needs); an error if it cannot be
    /// done at all. `commits`: how many commits ran for it already.
    fn admit(&self, m: &Meta, need: &Need, commits: u32) -> Result<Option<Credit<'_>>> {
        if need.tx.log_blocks() > self.tx_room() {
            return Err(Error::no_space(format!(
                "operation needs {} journal blocks, the journal takes {}",
                need.tx.log_blocks(),
                self.tx_room()
            )));
        }
        // The reserve keeps blocks for the commit's own metadata (extent chains) from
        // new blocks and inodes; a change that needs neither (a delete, a rename in
        // place, a chmod) is never refused for space: deleting is how space comes back.
        // A change that splits extents may grow an extent chain at its commit: it needs
        // the reserve untouched, or that commit could find no block and stop the file
        // system (a zero range on a full device: ENOSPC instead).
        let reserve = if need.blocks == 0 && !need.inode && !need.splits { 0 } else { Self::meta_reserve(m) };
        let short = m.available() < need.blocks + reserve || (need.inode && m.ifree == 0);
        if short {
            // Freed space comes back in stages: an unlinked inode is freed by a
            // commit, and its blocks are free once the commit after it is durable.
            // Under a burst of deletes and writes (50 threads of a file server) one
            // commit was not always enough, and a write failed with space on the way.
            if commits < 3 && (m.alloc.pending_blocks() > 0 || !m.to_free.is_empty()) {
                return Ok(None);
            }
            let what = if need.inode && m.ifree == 0 { "no free inodes" } else { "no free blocks" };
            return Err(Error::no_space(what));
        }
        // The room is promised at once: the data path registers inodes without the
        // metadata lock, and must not take it before this operation makes its changes.
        Ok(Credit::try_new(&self.tx, need.tx, self.tx_room()))
    }

    /// The metadata lock, held from an operation's checks through its change: `check`
    /// runs the checks and says what the change needs; while the running transaction
    /// has no room for it, that transaction commits (without the lock) and the
    /// checks run again, since others may have changed the namespace meanwhile.
    pub(crate) fn admitted<T>(
        &self,
        mut check: impl FnMut(&mut Meta) -> Result<(Need, T)>,
    ) -> Result<(Admitted<'_>, T)> {
        let mut commits = 0;
        loop {
            let mut m = self.meta.lock();
            let (need, v) = check(&mut m)?;
            if let Some(credit) = self.admit(&m, &need, commits)? {
                return Ok((Admitted { _unwinding: PoisonOnUnwind::new(self), m, credit }, v));
            }
            drop(m);
            self.commit()?;
            commits += 1;
        }
    }

    /// The log blocks operations are admitted into. A little of the journal is kept
    /// back: an inode that a write is in the middle of changing when a commit stores
    /// it stays registered in the next transaction without being admitted again (at
    /// most one table block for each writer in flight).
    /// Hitchhiking keeps back room for the data blocks the journal carries
    /// (`Hitchhike::reserve`).
    pub(crate) fn tx_room(&self) -> u64 {
        admission_room(self.tx_cap) - self.hitch.reserve()
    }

    /// Blocks kept back for metadata that commits allocate (extent chains).
    pub(crate) fn meta_reserve(m: &Meta) -> u64 {
        (m.sb.data_blocks() / 100).clamp(8, 1024)
    }
}

/// The log blocks operations may be admitted into, out of a journal of `tx_cap`, before
/// hitchhiking keeps its room back (see `FsInner::tx_room`).
pub(crate) fn admission_room(tx_cap: u64) -> u64 {
    tx_cap - (tx_cap / 8).min(64)
}

/// Poisons the file system if dropped while a panic unwinds: a change that panicked
/// half made (a bug) must not reach the medium with the next commit. The locks are not
/// poisoned by a panic, and an embedder (the C ABI, a FUSE request thread) may catch
/// it and go on; from then on the file system takes no changes, as after an I/O
/// error (ext4 stops itself on an internal error).
pub(crate) struct PoisonOnUnwind<'a>(&'a FsInner, bool);

impl<'a> PoisonOnUnwind<'a> {
    /// A guard for a change starting now. Made while this thread already unwinds (a
    /// `File` dropped by another panic frees its inode), it poisons nothing: only a
    /// panic that starts inside the change does (as std's mutex poisoning).
    pub(crate) fn new(fs: &'a FsInner) -> PoisonOnUnwind<'a> {
        PoisonOnUnwind(fs, std::thread::panicking())
    }
}

impl Drop for PoisonOnUnwind<'_> {
    fn drop(&mut self) {
        if !self.1 && std::thread::panicking() {
            self.0.poison(Error::io("a change panicked half made (a bug): nothing more is written"));
        }
    }
}

/// The metadata lock of an admitted operation, with the room promised to it in the
/// running transaction (released when this is dropped, after the changes are made).
pub(crate) struct Admitted<'a> {
    /// The admitted change is made under this: a panic in it (the caller's code,
    /// outside `mutate`) poisons the file system too. First, so that it is dropped
    /// first: the poison is set before the metadata lock is let go.
    _unwinding: PoisonOnUnwind<'a>,
    m: parking_lot::MutexGuard<'a, Meta>,
    credit: Credit<'a>,
}

impl<'a> Admitted<'a> {
    /// Unlock the metadata but keep the promised room, for an operation that makes its
    /// changes after I/O without the lock (truncate).
    pub fn keep_credit(self) -> Credit<'a> {
        self.credit
    }
}

impl std::ops::Deref for Admitted<'_> {
    type Target = Meta;
    fn deref(&self) -> &Meta {
        &self.m
    }
}

impl std::ops::DerefMut for Admitted<'_> {
    fn deref_mut(&mut self) -> &mut Meta {
        &mut self.m
    }
}

#[cfg(test)]
mod tests {
    use crate::device::mem::MemDevice;
    use crate::{Config, Fs, MkfsOptions};
    use std::sync::Arc;

    #[test]
    fn a_change_that_panics_turns_the_file_system_read_only() {
        let dev = Arc::new(MemDevice::new(16 << 20));
        crate::mkfs(&*dev, &MkfsOptions::default()).unwrap();
        let fs = Fs::mount(dev, Config::default()).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut m = fs.inner.meta.lock();
            let _ = fs.inner.mutate(&mut m, |_| -> crate::Result<()> { panic!("half made") });
        }));
        assert!(caught.is_err());
        assert!(fs.poisoned().is_some_and(|p| p.contains("panicked")), "{:?}", fs.poisoned());
        assert_eq!(fs.create_dir("/d", 0o755).unwrap_err().errno(), libc::EROFS);
        assert_eq!(fs.sync().unwrap_err().errno(), libc::EIO);
    }

    /// A caller's own panic that drops the last handle of an unlinked file frees it
    /// while unwinding: that change did not panic, and nothing is poisoned.
    #[test]
    fn a_panic_elsewhere_that_frees_a_file_poisons_nothing() {
        let dev = Arc::new(MemDevice::new(16 << 20));
        crate::mkfs(&*dev, &MkfsOptions::default()).unwrap();
        let fs = Fs::mount(dev, Config::default()).unwrap();
        let f = fs.create("/t").unwrap();
        f.write_at(b"data", 0).unwrap();
        fs.remove_file("/t").unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _last = f;
            panic!("the caller's own");
        }));
        assert!(caught.is_err());
        assert_eq!(fs.poisoned(), None);
        fs.create_dir("/d", 0o755).unwrap();
        fs.sync().unwrap();
    }
}
