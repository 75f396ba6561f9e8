//! writeback: dirty pages go home — placed (delayed allocation), written in runs,
//! overlapping their bookkeeping with the device; the write-back thread, dirty-data
//! pressure and writer throttling.

use crate::cache::Page;
use crate::device::{AlignedBuf, Op, OpKind};
use crate::error::Result;
use crate::format::BLOCK;
use crate::fs::meta::Meta;
use crate::fs::FsInner;
use crate::hitchhike::Route;
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// Data write-back whose requests are placed and on the device (`writeback_begin`),
/// ended with `writeback_end`. Dropped without that (a panic in the commit that
/// started it), it waits for its requests and gives the pages their buffers back,
/// still dirty: a page left on loan would keep every later reader and writer of it
/// waiting for good (the file system is poisoned by the panic and writes no more).
pub(crate) struct StartedWriteback {
    io: WritebackIo,
    /// The pages, in the order of the requests' buffers.
    written: Vec<Arc<Page>>,
    /// An error placing the pages (the rest were not written).
    mapped: Result<()>,
}

/// What a write-back is for.
#[derive(Clone, Copy)]
pub(crate) enum Wb<'a> {
    /// Freeing the cache (pressure, the write-back thread).
    Plain,
    /// A commit, for the fsyncs of these files if any.
    Commit(Option<&'a BTreeSet<u64>>),
    /// An fsync of these files, before the commit it may need.
    Sync(&'a BTreeSet<u64>),
}

impl StartedWriteback {
    /// Its parts, leaving nothing for `drop` to give back.
    fn take(&mut self) -> (WritebackIo, Vec<Arc<Page>>, Result<()>) {
        (
            std::mem::replace(&mut self.io, WritebackIo::Done(Vec::new())),
            std::mem::take(&mut self.written),
            std::mem::replace(&mut self.mapped, Ok(())),
        )
    }
}

impl WritebackIo {
    /// The requests' results, waited for if they are still in flight.
    fn wait(self) -> Vec<crate::device::Done> {
        match self {
            WritebackIo::Done(done) => done,
            WritebackIo::Started(started) => started.into_iter().flat_map(crate::device::Pending::wait).collect(),
        }
    }
}

impl Drop for StartedWriteback {
    fn drop(&mut self) {
        let (io, written, _) = self.take();
        if written.is_empty() {
            return;
        }
        let mut written = written.into_iter();
        for buf in io.wait().into_iter().flat_map(|d| d.bufs) {
            if let Some(p) = written.next() {
                p.abort_writeback(buf);
            }
        }
    }
}

enum WritebackIo {
    /// Already waited for (`submit_stream`).
    Done(Vec<crate::device::Done>),
    /// In flight.
    Started(Vec<crate::device::Pending>),
}

pub(crate) fn writeback_thread(fs: Weak<FsInner>, wake: Arc<(Mutex<bool>, Condvar)>, every: std::time::Duration) {
    // When this thread last committed: a writer that keeps kicking it (a long stream
    // of writes) must not keep the interval's commit from coming.
    let mut last_commit = std::time::Instant::now();
    loop {
        {
            let mut stop = wake.0.lock();
            if *stop {
                return;
            }
            wake.1.wait_for(&mut stop, every);
            if *stop {
                return;
            }
        }
        let Some(inner) = fs.upgrade() else { return };
        if inner.poisoned.lock().is_none() {
            // Errors poison the file system; the next caller sees them.
            let kicked = inner.kick.swap(false, Ordering::Relaxed);
            if kicked {
                // Write back until well under the limit, waking throttled writers
                // after every round.
                loop {
                    let before = inner.stats.data_writes.load(Ordering::Relaxed);
                    let r = inner.writeback_pressure();
                    // Nothing written: what is dirty waits for a commit (pages the
                    // journal carries), or for a fetch.
                    let stuck = inner.stats.data_writes.load(Ordering::Relaxed) == before;
                    // Under the lock the writers check under: no wake-up is lost.
                    drop(inner.throttle.0.lock());
                    inner.throttle.1.notify_all();
                    if let Err(e) = &r {
                        tracing::error!("background write-back failed: {e}");
                    }
                    if r.is_err() || stuck || inner.pressure() < 0.25 {
                        break;
                    }
                }
            }
            // A commit every interval, and whenever the transaction grew big.
            let interval = !kicked || last_commit.elapsed() >= every;
            if interval || inner.commit_due.swap(false, Ordering::AcqRel) {
                inner.commit_due.store(false, Ordering::Release);
                if interval {
                    inner.hitchhike_age();
                }
                if let Err(e) = inner.commit() {
                    tracing::error!("periodic commit failed: {e}");
                }
                last_commit = std::time::Instant::now();
            }
        }
    }
}

impl FsInner {
    /// Age the hitchhiking buffer (once per interval of the write-back thread): the
    /// pages of blocks it lets go are marked dirty, so that the next commit writes them
    /// home whole and revokes their records.
    pub(crate) fn hitchhike_age(&self) {
        self.mark_pages_dirty(self.hitch.age());
    }

    /// Write home whole the blocks of `ino` the journal carries (hitchhiking), so that
    /// the medium's copies are current: before an operation that drops the file's
    /// pages and reads its blocks back from their new places. The caller holds the
    /// commit lock.
    pub(crate) fn hitchhike_settle_file(&self, ino: u64) -> Result<()> {
        let pages = self.hitch.mark_file(ino);
        if pages.is_empty() {
            return Ok(());
        }
        self.mark_pages_dirty(pages);
        self.commit_locked()
    }

    fn mark_pages_dirty(&self, pages: Vec<Arc<Page>>) {
        for p in pages {
            let mut g = p.lock();
            if g.state == crate::cache::PageState::UpToDate {
                g.state = crate::cache::PageState::Dirty;
                drop(g);
                self.cache.mark_dirty_if_held(&p);
            }
        }
    }

    /// How full the cache is of changes not yet written: dirty pages against the
    /// dirty limit, or patch bytes against patch memory, whichever is fuller (1.0 is
    /// at the limit). Write-back starts at 0.5 and writers wait at 1.0; a Lazy fetch
    /// happens here, under patch-memory pressure.
    pub fn pressure(&self) -> f64 {
        let dirty = self.dirty_pages() as f64 / self.dirty_limit();
        let patches =
            self.stats.patch_bytes.load(Ordering::Relaxed).max(0) as f64 / self.config.patch_bytes.max(1) as f64;
        dirty.max(patches)
    }

    /// Dirty pages the cache may hold before writers wait (pressure 1.0).
    fn dirty_limit(&self) -> f64 {
        self.cache.capacity() as f64 * self.config.dirty_ratio
    }

    /// Dirty pages that hold a page buffer (pages with only patches are bounded by
    /// patch memory instead).
    pub fn dirty_pages(&self) -> usize {
        let patched = self.stats.patched_pages.load(Ordering::Relaxed).max(0) as usize;
        self.cache.dirty_count().saturating_sub(patched)
    }

    /// Write-back under dirty-data pressure: the files dirtied longest ago first (as
    /// Linux's flusher takes inodes by when they were dirtied), as many as bring the
    /// dirty pages under a quarter of the limit. A file being written keeps its pages
    /// while older ones go: its writers do not meet their pages under write-back
    /// (lent to the device), and pages dirtied again at once are not written over and
    /// over. Without a commit, as `writeback`.
    pub(crate) fn writeback_pressure(&self) -> Result<()> {
        self.check_alive()?;
        let _c = self.commit_lock.lock();
        let need = (self.dirty_pages() as f64 - self.dirty_limit() / 4.0).max(1.0) as usize;
        let mut files: Vec<(u64, u64, usize)> = self
            .cache
            .dirty_by_inode()
            .into_iter()
            .map(|(ino, n)| (self.inodes.get(ino).map_or(0, |c| c.dirtied_in.load(Ordering::Relaxed)), ino, n))
            .collect();
        files.sort_unstable();
        let all = files.len();
        let mut picked = BTreeSet::new();
        let mut sum = 0;
        for (_, ino, n) in files {
            if sum >= need {
                break;
            }
            picked.insert(ino);
            sum += n;
        }
        let before = self.stats.data_writes.load(Ordering::Relaxed);
        self.writeback_of(Some(&picked))?;
        // The files taken had nothing that could go now (blocks the journal carries
        // wait for a commit, pages for their fetch): the others go, rather than the
        // round ending with nothing written and throttled writers waiting for the
        // next.
        if picked.len() < all && self.stats.data_writes.load(Ordering::Relaxed) == before {
            self.writeback_of(None)?;
        }
        Ok(())
    }

    /// Write dirty data home without committing: frees the cache for more writes.
    /// Ordered mode holds, since the data goes out before any commit that maps it.
    pub fn writeback(&self) -> Result<()> {
        self.check_alive()?;
        let _c = self.commit_lock.lock();
        self.writeback_locked().map(|_| ())
    }

    /// Write every dirty page home, allocating blocks for unmapped pages. Returns
    /// whether anything was written. The caller holds the commit lock.
    pub(crate) fn writeback_locked(&self) -> Result<bool> {
        self.writeback_locked_for(None)
    }

    /// `writeback_locked`, or for fsyncs of `files`: their dirty pages, and those of
    /// every file whose size or block map changed since it was last stored (the
    /// commit that follows stores that change, which must not point past data on the
    /// medium: ordered mode). Overwrites of other files' blocks stay in the cache: an
    /// fsync does not pay for every file's dirty data (ext4 does the same).
    pub(crate) fn writeback_locked_for(&self, files: Option<&BTreeSet<u64>>) -> Result<bool> {
        let selection = self.writeback_selection(files);
        self.writeback_of(selection.as_ref())
    }

    /// Write back the dirty pages of exactly the inodes in `selection` (None: all).
    pub(crate) fn writeback_of(&self, selection: Option<&BTreeSet<u64>>) -> Result<bool> {
        self.writeback_for(selection, Wb::Plain)
    }

    /// `writeback_of`, for a commit or an fsync (`Wb`).
    pub(crate) fn writeback_for(&self, selection: Option<&BTreeSet<u64>>, why: Wb<'_>) -> Result<bool> {
        match self.writeback_begin(false, selection, why)? {
            None => Ok(false),
            Some(s) => self.writeback_end(s).map(|()| true),
        }
    }

    /// The inodes whose dirty pages a commit for fsyncs of `files` writes (None: all
    /// of them): those files, and every file with dirty pages whose size or block map
    /// changed since it was last stored. Decided outside the cache's locks (an
    /// inode's lock is not taken under them).
    pub(crate) fn writeback_selection(&self, files: Option<&BTreeSet<u64>>) -> Option<BTreeSet<u64>> {
        let files = files?;
        let mut inos = self.cache.dirty_inodes();
        inos.retain(|ino| files.contains(ino) || self.inodes.get(*ino).is_none_or(|c| c.lock().data_meta_dirty));
        inos.extend(files.iter().copied());
        Some(inos)
    }

    /// Before a commit takes the size gate: the dirty pages it will write that still
    /// need their data (patches: resolved; being fetched: waited for), so that the
    /// gate, which holds back writes that grow files, is not held across that I/O.
    /// Pages that get patches meanwhile are settled under the gate (rare).
    pub(crate) fn settle_for_commit(&self, files: Option<&BTreeSet<u64>>) {
        let selection = self.writeback_selection(files);
        self.settle_pages(&self.cache.dirty_pages(selection.as_ref()));
    }

    /// Give pages about to be written their data: pages with patches are fetched and
    /// patched (a failed fetch is remembered for the file's next fsync; its page is
    /// dropped and not written), then every page another thread is fetching —
    /// including one the fetcher claimed between the look and `resolve` — is waited
    /// for, so that all of them are written now: an fsync must not return before.
    fn settle_pages(&self, pages: &[Arc<Page>]) {
        let mut by_ino: std::collections::BTreeMap<u64, Vec<Arc<Page>>> = Default::default();
        for p in pages {
            if p.lock().state == crate::cache::PageState::Outdated {
                by_ino.entry(p.key.0).or_default().push(p.clone());
            }
        }
        for (ino, ps) in by_ino {
            let _ = self.resolve(ino, ps);
        }
        for p in pages {
            drop(p.wait());
        }
    }

    /// Whether data was written since the last flush, forgetting it: the flush the
    /// caller is about to make covers it. Write-back that is not part of a commit
    /// (the write-back thread under pressure, an fdatasync) leaves data in the disk's
    /// volatile cache; an fsync that finds nothing else to do must still flush it.
    /// Under the commit lock, like every write-back.
    pub(crate) fn take_unflushed(&self) -> bool {
        self.unflushed.swap(false, Ordering::AcqRel)
    }

    /// Place every dirty page (of the inodes in `selection`, see `writeback_selection`)
    /// and put its write on the device. `overlap` false: the
    /// writes are waited for here, each chunk's bookkeeping overlapping the writes
    /// of the chunks before it (`writeback_end` only settles the pages). `overlap`
    /// true (the asynchronous stack's commit): every chunk is started and none waited
    /// for, so that the caller builds and starts the journal while the data is in
    /// flight. None if nothing was dirty. The caller holds the commit lock.
    /// `why`: what the write-back is for, so that `hitchhike` may carry pages in a
    /// commit's journal transaction instead of writing them in place.
    pub(crate) fn writeback_begin(
        &self,
        overlap: bool,
        selection: Option<&BTreeSet<u64>>,
        why: Wb<'_>,
    ) -> Result<Option<StartedWriteback>> {
        self.wb_round.fetch_add(1, Ordering::Relaxed);
        let pages = match selection {
            None => self.cache.take_dirty(),
            Some(inos) => self.cache.take_dirty_of(inos),
        };
        if pages.is_empty() {
            return Ok(None);
        }
        self.settle_pages(&pages);
        // A commit of a few pages may log them whole rather than write them in place
        // (hitchhiking): with no data in flight its journal needs no flush of its own.
        let small = pages.len() <= crate::hitchhike::SMALL_COMMIT;
        // Pages are prepared (mapped, allocated, turned into requests) a chunk at a
        // time, while the device writes the chunks before: the bookkeeping of write-back
        // overlaps its I/O instead of leaving the device idle.
        const CHUNK: usize = 2048;
        let mut pages = pages.into_iter();
        let mut written: Vec<Arc<Page>> = Vec::new();
        let mut mapped = Ok(());
        let mut next = || -> Option<Vec<Op>> {
            while mapped.is_ok() {
                let chunk: Vec<Arc<Page>> = pages.by_ref().take(CHUNK).collect();
                if chunk.is_empty() {
                    return None;
                }
                let ops = self.prepare_writeback(chunk, &mut written, &mut mapped, why, small);
                if !ops.is_empty() {
                    return Some(ops);
                }
            }
            None
        };
        crate::aios::submitting();
        let io = if overlap {
            let mut started = Vec::new();
            while let Some(ops) = next() {
                started.push(self.dev.start(ops));
            }
            WritebackIo::Started(started)
        } else {
            WritebackIo::Done(self.dev.submit_stream(&mut next))
        };
        Ok(Some(StartedWriteback { io, written, mapped }))
    }

    /// Wait for a write-back's requests and give the pages their buffers back; an
    /// error (of placing or of writing) poisons the file system.
    pub(crate) fn writeback_end(&self, mut s: StartedWriteback) -> Result<()> {
        let (io, written, mapped) = s.take();
        let done = io.wait();
        crate::aios::completed();
        if !written.is_empty() {
            self.unflushed.store(true, Ordering::Release);
        }
        self.stats.data_writes.fetch_add(written.len() as u64, Ordering::Relaxed);
        let mut result = mapped;
        let mut written = written.into_iter();
        for d in done {
            if let Err(e) = d.result {
                result = Err(e.into());
            }
            // Buffers come back even on error; the pages get them back either way.
            for buf in d.bufs {
                written.next().expect("one page per buffer").end_writeback(buf);
            }
        }
        result.map_err(|e| self.poison(e))
    }

    /// Lend the buffers of `chunk`'s dirty pages to write-back, place them (allocating
    /// blocks as contiguous runs) and build the write requests; `written` receives the
    /// pages in the order of the requests' buffers. Pages that need no write get their
    /// buffers back at once.
    fn prepare_writeback(
        &self,
        chunk: Vec<Arc<Page>>,
        written: &mut Vec<Arc<Page>>,
        mapped: &mut Result<()>,
        why: Wb<'_>,
        small: bool,
    ) -> Vec<Op> {
        let mut items: Vec<(Arc<Page>, AlignedBuf)> = Vec::with_capacity(chunk.len());
        for p in chunk {
            match p.begin_writeback() {
                Some(buf) => items.push((p, buf)),
                // Not writable now but still holding unwritten changes (it got patches
                // again meanwhile): it stays dirty for the next write-back.
                None => {
                    let g = p.lock();
                    let pending =
                        matches!(g.state, crate::cache::PageState::Outdated | crate::cache::PageState::Fetching);
                    if pending && !g.failed {
                        drop(g);
                        self.cache.mark_dirty(p.key);
                    }
                }
            }
        }
        // A page dropped from the cache meanwhile (truncate, delete) has nothing to write.
        let held = self.cache.holds_all(items.iter().map(|i| &i.0));
        let mut unplaced = Vec::new();
        let mut kept = Vec::with_capacity(items.len());
        for (item, h) in items.into_iter().zip(held) {
            if h {
                kept.push(item);
            } else {
                unplaced.push(item);
            }
        }
        let mut placed: Vec<(u64, Arc<Page>, AlignedBuf)> = Vec::with_capacity(kept.len());
        // Pages past the end of file: a write that extends the file marks its pages
        // dirty before it publishes the new size (so that no commit stores a size
        // over data that is not dirty yet); they stay dirty for the write-back after
        // it. (Pages of a truncate or a delete in progress are dropped by it.)
        let mut past_end: Vec<(Arc<Page>, AlignedBuf)> = Vec::new();
        // Pages the journal carries (clean once their buffers are back) and pages
        // that must wait for a commit (`hitchhike::Route`).
        let mut journaled: Vec<(Arc<Page>, AlignedBuf)> = Vec::new();
        let mut wait: Vec<(Arc<Page>, AlignedBuf)> = Vec::new();
        {
            let mut m = self.meta.lock();
            // Blocks are allocated and mapped under this: a panic poisons.
            let _unwinding = crate::commit::PoisonOnUnwind::new(self);
            let mut items = kept.into_iter().peekable();
            while let Some(first) = items.next() {
                let (ino, idx) = first.0.key;
                let mut run = vec![first];
                while items.peek().is_some_and(|(p, _)| p.key == (ino, idx + run.len() as u64)) {
                    run.push(items.next().expect("peeked"));
                }
                let phys = match self.map_run(&mut m, ino, idx, run.len() as u64) {
                    Ok(v) => v,
                    Err(e) => {
                        *mapped = Err(e);
                        unplaced.extend(run);
                        unplaced.extend(items.by_ref());
                        break;
                    }
                };
                for ((p, buf), b) in run.into_iter().zip(phys) {
                    let Some((b, fresh)) = b else {
                        past_end.push((p, buf));
                        continue;
                    };
                    // Under the metadata lock: a block freed meanwhile is not staged.
                    let (commit, sync) = match why {
                        Wb::Plain => (false, None),
                        Wb::Commit(sync) => (true, sync),
                        Wb::Sync(sync) => (false, Some(sync)),
                    };
                    let sync = sync.is_some_and(|f| f.contains(&ino));
                    match self.hitch.route(b, &p, &buf, commit, sync, small, fresh) {
                        Route::InPlace => placed.push((b, p, buf)),
                        Route::Journal => journaled.push((p, buf)),
                        Route::Keep => wait.push((p, buf)),
                    }
                }
            }
        }
        unplaced.into_iter().for_each(|(p, buf)| p.end_writeback(buf));
        journaled.into_iter().for_each(|(p, buf)| p.end_writeback(buf));
        for (p, buf) in past_end.into_iter().chain(wait) {
            p.abort_writeback(buf);
            self.cache.mark_dirty_if_held(&p);
        }
        placed.sort_by_key(|p| p.0);
        let mut ops: Vec<Op> = Vec::new();
        let mut last: Option<u64> = None;
        for (b, page, buf) in placed {
            match (ops.last_mut(), last) {
                (Some(op), Some(l)) if l + 1 == b && op.bufs.len() < 256 => op.bufs.push(buf),
                _ => ops.push(Op { kind: OpKind::Write, offset: b * BLOCK, bufs: vec![buf] }),
            }
            last = Some(b);
            written.push(page);
        }
        ops
    }

    /// Device blocks for `n` consecutive pages of `ino` from `idx`, allocating the
    /// unmapped ones; None for pages past the end of the file or of a freed inode.
    /// With each block, whether it is fresh: allocated now, or unwritten until now
    /// (what it held before reads as zeros).
    fn map_run(&self, m: &mut Meta, ino: u64, idx: u64, n: u64) -> Result<Vec<Option<(u64, bool)>>> {
        let Ok(cell) = m.cell(ino) else {
            return Ok(vec![None; n as usize]);
        };
        let tx = m.tx.clone();
        let mut node = cell.lock();
        if node.freed {
            return Ok(vec![None; n as usize]);
        }
        let pages = node.d.size.div_ceil(BLOCK);
        let mut out = Vec::with_capacity(n as usize);
        let mut k = 0;
        while k < n {
            let lblk = idx + k;
            if lblk >= pages {
                out.push(None);
                k += 1;
                continue;
            }
            if let Some(b) = node.map(lblk) {
                // An unwritten block is written from now on: in the transaction that
                // this write-back precedes (as for a new allocation).
                let mut fresh = false;
                if node.is_unwritten(lblk) && node.set_written(lblk, lblk + 1, false) {
                    node.data_meta_dirty = true;
                    node.register(&tx, None);
                    fresh = true;
                }
                node.converting.remove(&lblk);
                out.push(Some((b, fresh)));
                k += 1;
                continue;
            }
            // Unmapped: allocate as much of the rest of the run as is unmapped.
            let mut want = 1;
            while k + want < n && idx + k + want < pages && node.map(idx + k + want).is_none() {
                want += 1;
            }
            let goal = lblk.checked_sub(1).and_then(|p| node.map(p)).map(|b| b + 1);
            let (first, got) = m.alloc_data(want, goal)?;
            node.add_mapping(lblk, first, got);
            let mut unreserved = 0;
            for i in 0..got {
                if node.reserved.remove(&(lblk + i)) {
                    unreserved += 1;
                }
            }
            m.add_reserved(-unreserved);
            node.data_meta_dirty = true;
            node.register(&tx, None);
            for i in 0..got {
                out.push(Some((first + i, true)));
            }
            k += got;
        }
        Ok(out)
    }
}
