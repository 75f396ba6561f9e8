//! nbw: non-blocking writes (mechanism 1, DESIGN.md §1.1). A partial write to a page
//! that is not in memory is kept as a patch and returns at once; the page is fetched
//! later — by the writer's own request (Async-FG), the fetcher thread (Async-BG), or
//! write-back (Lazy) — and the patches are applied in order when its data arrives.
//! `FetchPolicy::Blocking` is the off-switch. This module holds the patch queue of a
//! page, the fetch of pages from the device (where patches meet their data), and the
//! fetcher thread.

use crate::cache::{Page, PageData};
use crate::device::{DevError, Op, OpKind, Pending};
use crate::error::{Error, Result};
use crate::format::{BLOCK, BLOCK_SIZE};
use crate::fs::FsInner;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// Bytes written at an offset within a page.
#[derive(Debug, Clone)]
pub struct Patch {
    pub offset: u16,
    pub data: Vec<u8>,
}

impl PageData {
    /// Record a write as a patch, in FIFO order. Patches at the tail of the queue that
    /// overlap or touch the new one merge into it (their bytes first, the new ones on
    /// top): merging only from the tail never lets older bytes overtake newer ones.
    /// Returns the change in patch bytes.
    pub fn add_patch(&mut self, offset: usize, data: &[u8]) -> isize {
        let before = self.patch_bytes();
        let (mut start, mut end) = (offset, offset + data.len());
        let mut absorbed = Vec::new();
        while let Some(last) = self.patches.last() {
            let (ps, pe) = (last.offset as usize, last.offset as usize + last.data.len());
            if pe < start || ps > end {
                break;
            }
            start = start.min(ps);
            end = end.max(pe);
            absorbed.push(self.patches.pop().expect("checked"));
        }
        let mut merged = vec![0u8; end - start];
        // Oldest first; every absorbed patch touches the growing range, so the merged
        // bytes are all written.
        for p in absorbed.iter().rev() {
            let at = p.offset as usize - start;
            merged[at..at + p.data.len()].copy_from_slice(&p.data);
        }
        merged[offset - start..offset - start + data.len()].copy_from_slice(data);
        self.patches.push(Patch { offset: start as u16, data: merged });
        self.patch_bytes() as isize - before as isize
    }

    /// Whether the patches together cover every byte of the page (its old data is
    /// then not needed at all).
    pub fn patches_cover_page(&self) -> bool {
        self.patches_cover(0, BLOCK_SIZE)
    }

    /// Bytes held in patches.
    pub fn patch_bytes(&self) -> usize {
        self.patches.iter().map(|p| p.data.len()).sum()
    }

    /// Whether the patches hold every byte of `offset..offset + len` (what
    /// `read_patches` would serve), without copying them.
    pub fn patches_cover(&self, offset: usize, len: usize) -> bool {
        let mut runs: Vec<(usize, usize)> = self
            .patches
            .iter()
            .map(|p| (p.offset as usize, p.offset as usize + p.data.len()))
            .filter(|&(s, e)| s < offset + len && e > offset)
            .collect();
        runs.sort_unstable();
        let mut covered = offset;
        for (s, e) in runs {
            if s > covered {
                return false;
            }
            covered = covered.max(e);
        }
        covered >= offset + len
    }

    /// Copy `out.len()` bytes at `offset` from the patches if they cover all of them
    /// (in their order: a later patch over an earlier one); false, copying nothing,
    /// if they do not.
    pub fn read_patches(&self, offset: usize, out: &mut [u8]) -> bool {
        if !self.patches_cover(offset, out.len()) {
            return false;
        }
        for p in &self.patches {
            let (ps, pe) = (p.offset as usize, p.offset as usize + p.data.len());
            let (s, e) = (ps.max(offset), pe.min(offset + out.len()));
            if s < e {
                out[s - offset..e - offset].copy_from_slice(&p.data[s - ps..e - ps]);
            }
        }
        true
    }
}

/// Fetches the pages a sequential reader will ask for next, while it copies out
/// the ones it has: the device works while the CPU does.
/// Resolves pages with patches (reads their data, applies the patches) in the
/// background, for the asynchronous fetch policies.
/// What the fetcher thread is asked to do.
pub(crate) enum FetchMsg {
    /// Async-BG: read this page (it holds patches) and apply its patches.
    Resolve(u64, u64),
    /// Async-FG: the writer started the read itself; complete it.
    Started(StartedFetch),
}

/// A fetch on the device: its pages (Fetching) and which of them each op fills.
pub(crate) struct StartedFetch {
    pub ino: u64,
    pub pages: Vec<Arc<Page>>,
    /// For each request, the page (index in `pages`) each of its buffers fills, or
    /// [`DISCARD`] for a buffer read for nothing (a page someone else cached first).
    pub owners: Vec<Vec<usize>>,
    pub pending: Pending,
}

/// An owner slot of a buffer whose data nobody takes.
pub(crate) const DISCARD: usize = usize::MAX;

/// Fetches the fetcher could not complete because the file system was being dropped:
/// `shutdown` completes them (their pages are dirty, and the last commit waits for
/// them).
pub(crate) type Leftover = Arc<parking_lot::Mutex<Vec<StartedFetch>>>;

pub(crate) fn fetcher_thread(fs: Weak<FsInner>, rx: std::sync::mpsc::Receiver<FetchMsg>, leftover: Leftover) {
    while let Ok(first) = rx.recv() {
        // Everything queued meanwhile goes to the device in one batch; fetches writers
        // started are completed as they come.
        let mut batch: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
        let mut started = Vec::new();
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                FetchMsg::Resolve(ino, idx) => batch.entry(ino).or_default().push(idx),
                FetchMsg::Started(s) => started.push(s),
            }
            if batch.values().map(Vec::len).sum::<usize>() + started.len() >= 256 {
                break;
            }
            next = rx.try_recv().ok();
        }
        let Some(inner) = fs.upgrade() else {
            // Being dropped: hand what writers started to `shutdown`, which runs after
            // this thread has ended.
            let mut left = leftover.lock();
            left.extend(started);
            while let Ok(msg) = rx.try_recv() {
                if let FetchMsg::Started(s) = msg {
                    left.push(s);
                }
            }
            drop(left);
            continue;
        };
        for s in started {
            let ino = s.ino;
            if let Err(e) = inner.finish_fetch(s) {
                tracing::warn!(ino, "fetch for non-blocking writes failed: {e}");
            }
        }
        for (ino, idxs) in batch {
            // The pages are claimed under the inode lock (as a reader: a truncate sees
            // them in the cache and waits for them), and read without it, so that
            // writers to other pages of the file do not wait for this I/O.
            let Ok(cell) = inner.cell(ino) else { continue };
            let claimed = {
                let _g = cell.io.read();
                let pages: Vec<Arc<Page>> = idxs.into_iter().filter_map(|i| inner.cache.get((ino, i))).collect();
                inner.claim(pages)
            };
            if let Err(e) = inner.fetch(ino, claimed) {
                // The writes are reported lost by the file's next fsync or close.
                tracing::warn!(ino, "background fetch for non-blocking writes failed: {e}");
            }
        }
    }
}

impl FsInner {
    /// A fetch failed: waiters get EIO, the page leaves the cache, and if writes had
    /// already returned with patches on it, the file's next fsync reports the loss.
    /// With `rescue`, a page whose patches cover it is kept instead (a failed read):
    /// returns false then.
    fn fail_page(&self, ino: u64, page: &Page, rescue: bool) -> bool {
        // The patches are taken, so that no one settles them a second time (a truncate
        // that waited for this page), and the page marked failed under the same lock:
        // a writer that finds it fetching after this adds no patch to be lost unseen.
        let mut g = page.lock();
        // Writes that covered the whole page need none of its old data: the page is
        // theirs, dirty, and not lost (a whole-page write joins a fetch in flight as a
        // patch; it is also how a bad sector gets rewritten).
        if rescue && g.patches_cover_page() {
            self.settle_patches(g.patch_bytes());
            page.complete(g, self.dev.alloc_zeroed(BLOCK_SIZE));
            return false;
        }
        let lost: usize = std::mem::take(&mut g.patches).iter().map(|p| p.data.len()).sum();
        if lost > 0 {
            // Recorded before the page is seen failed (the page's lock is held; the
            // errors' lock is a leaf): whoever waited for the page (an fsync settling
            // its pages, the freeing of the inode) finds the loss recorded.
            let mut errors = self.fetch_errors.lock();
            self.any_lost.store(true, std::sync::atomic::Ordering::Release);
            let e = errors.entry(ino).or_default();
            e.seq += 1;
            e.seen = false;
        }
        g.failed = true;
        drop(g);
        if lost > 0 {
            self.settle_patches(lost);
            tracing::error!(
                ino,
                page = page.key.1,
                lost,
                "bytes written earlier were lost: their page could not be read; the file's next fsync reports EIO"
            );
            if let Some(tell) = self.lost_writes.get() {
                tell(ino, page.key.1);
            }
        }
        self.cache.fail(page);
        true
    }

    /// A page's patches (`bytes`, 0 if it had none) leave patch memory: applied to its
    /// data (under the page lock, before the page becomes readable), dropped with the
    /// page, or lost with a failed fetch.
    pub(crate) fn settle_patches(&self, bytes: usize) {
        if bytes > 0 {
            self.stats.patch_bytes.fetch_sub(bytes as i64, Ordering::Relaxed);
            self.stats.patched_pages.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Settle the patch accounting of pages dropped from the cache (truncate, delete).
    pub fn forget_pages(&self, pages: Vec<Arc<Page>>) {
        for p in pages {
            // A page the fetcher or readahead is reading (they hold no inode lock
            // during I/O) is waited for; taking its patches means a fetch that claims
            // it later applies nothing and nothing is counted twice.
            let patches = std::mem::take(&mut p.wait().patches);
            self.settle_patches(patches.iter().map(|p| p.data.len()).sum());
        }
    }

    /// Fetch the data of pages that hold patches, apply the patches, and make them
    /// ordinary dirty pages. Pages already being fetched are waited for.
    pub fn resolve(&self, ino: u64, pages: Vec<Arc<Page>>) -> Result<()> {
        let claimed = self.claim(pages);
        self.fetch(ino, claimed)
    }

    /// The pages that hold patches (Outdated), now Fetching and ours to fetch.
    pub fn claim(&self, pages: Vec<Arc<Page>>) -> Vec<Arc<Page>> {
        let mut claimed = Vec::new();
        for p in pages {
            let mut g = p.lock();
            if g.state == crate::cache::PageState::Outdated {
                g.state = crate::cache::PageState::Fetching;
                drop(g);
                claimed.push(p);
            }
        }
        claimed
    }

    /// Whether `n` more bytes of patches fit in the configured patch memory.
    pub fn patch_room(&self, n: usize) -> bool {
        self.stats.patch_bytes.load(Ordering::Relaxed) + n as i64 <= self.config.patch_bytes as i64
    }

    /// Whether one more page not in memory may hold only patches: each takes a whole
    /// page when it is resolved (at the latest by the next commit, all at once), and
    /// the cache cannot evict it before. Each page counts as at least 2 KiB of the
    /// patch memory (the size of the paper's small writes, which the byte bound alone
    /// stops at the same point): 16-byte patches within the patch memory were millions
    /// of pages, gigabytes at the commit; now at most twice the patch memory.
    pub fn patch_page_room(&self) -> bool {
        let pages = self.stats.patched_pages.load(Ordering::Relaxed).max(0) as u64;
        pages < (self.config.patch_bytes / 2048).max(16)
    }

    /// Queue a page with patches for the fetcher thread (Async-BG).
    pub fn queue_fetch(&self, ino: u64, idx: u64) {
        if let Some(q) = &*self.fetch_queue.lock() {
            let _ = q.send(FetchMsg::Resolve(ino, idx));
        }
    }

    /// Async-FG: the writer of a patch to a page not in memory resolves the page's
    /// block and starts its read itself, without waiting; the fetcher thread completes
    /// it (applies the patches) when the device is done. So the read is on the device
    /// when the write returns, and Async-BG (the fetcher does both) is another path.
    pub fn start_fetch_for_writer(&self, ino: u64, page: Arc<Page>) {
        let claimed = self.claim(vec![page]);
        if claimed.is_empty() {
            return;
        }
        let started = match self.start_fetch(ino, claimed) {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(ino, "fetch for non-blocking writes failed: {e}");
                return;
            }
        };
        let rejected = match &*self.fetch_queue.lock() {
            Some(q) => q.send(FetchMsg::Started(started)).err().map(|e| e.0),
            None => Some(FetchMsg::Started(started)),
        };
        // Shutting down: complete it here.
        if let Some(FetchMsg::Started(s)) = rejected {
            if let Err(e) = self.finish_fetch(s) {
                tracing::warn!(ino, "fetch for non-blocking writes failed: {e}");
            }
        }
    }

    /// Read the given freshly inserted (Fetching) pages of `ino` from the device, or
    /// zero-fill the ones that map to no block. A page whose read fails is failed; the
    /// first error is returned.
    ///
    /// Pages go to the device and become readable a chunk at a time: a thread waiting
    /// for one page of a big fetch (write-back resolving every patched page under Lazy)
    /// waits for its chunk, not for the whole fetch.
    pub fn fetch(&self, ino: u64, mut pages: Vec<Arc<Page>>) -> Result<()> {
        const CHUNK: usize = 256;
        let mut result = Ok(());
        while !pages.is_empty() {
            let rest = pages.split_off(pages.len().min(CHUNK));
            let r = self.fetch_chunk(ino, std::mem::replace(&mut pages, rest));
            if result.is_ok() {
                result = r;
            }
        }
        result
    }

    fn fetch_chunk(&self, ino: u64, pages: Vec<Arc<Page>>) -> Result<()> {
        match self.start_fetch(ino, pages)? {
            Some(s) => self.finish_fetch(s),
            None => Ok(()),
        }
    }

    /// Map the given Fetching pages of `ino` and start their reads (pages that map to
    /// no block are zero-filled at once); None if nothing needs the device.
    fn start_fetch(&self, ino: u64, pages: Vec<Arc<Page>>) -> Result<Option<StartedFetch>> {
        // The block map is the inode's: no metadata lock on the read path.
        let maps: Result<Vec<Option<u64>>> = self.cell(ino).map(|cell| {
            let node = cell.lock();
            pages.iter().map(|p| if node.freed { None } else { node.map_data(p.key.1) }).collect()
        });
        let maps = match maps {
            Ok(v) => v,
            Err(e) => {
                // The inode could not be had (not its data): nothing is kept.
                pages.iter().for_each(|p| {
                    self.fail_page(ino, p, false);
                });
                return Err(e);
            }
        };
        for (p, b) in pages.iter().zip(&maps) {
            if b.is_none() {
                let g = p.lock();
                self.settle_patches(g.patch_bytes());
                p.complete(g, self.dev.alloc_zeroed(BLOCK_SIZE));
            }
        }
        let (ops, owners) = self.read_requests(&maps);
        if ops.is_empty() {
            return Ok(None);
        }
        let pending = self.start_reads(ops);
        Ok(Some(StartedFetch { ino, pages, owners, pending }))
    }

    /// Read requests for the blocks `maps` gives (None: no block, nothing to read):
    /// one request per run of consecutive blocks (at most 256), buffers from the
    /// device's registered pool; with each request, the indexes in `maps` its buffers
    /// are for, in order.
    pub(crate) fn read_requests(&self, maps: &[Option<u64>]) -> (Vec<Op>, Vec<Vec<usize>>) {
        let mut ops: Vec<Op> = Vec::new();
        let mut owners: Vec<Vec<usize>> = Vec::new();
        let mut last: Option<u64> = None;
        for (i, b) in maps.iter().enumerate() {
            let Some(b) = *b else {
                last = None;
                continue;
            };
            let buf = self.dev.alloc(BLOCK_SIZE);
            match (ops.last_mut(), last) {
                (Some(op), Some(l)) if l + 1 == b && op.bufs.len() < 256 => {
                    op.bufs.push(buf);
                    owners.last_mut().expect("paired").push(i);
                }
                _ => {
                    ops.push(Op { kind: OpKind::Read, offset: b * BLOCK, bufs: vec![buf] });
                    owners.push(vec![i]);
                }
            }
            last = Some(b);
        }
        (ops, owners)
    }

    /// Put data reads on the device (counted, and marked for `Config::trace_io`).
    pub(crate) fn start_reads(&self, ops: Vec<Op>) -> Pending {
        self.stats.data_reads.fetch_add(ops.len() as u64, Ordering::Relaxed);
        crate::aios::submitting();
        self.dev.start(ops)
    }

    /// Wait for a started fetch and complete its pages: patches applied in order, the
    /// page readable; a failed read fails its pages. A read the kernel cancelled (the
    /// thread that started it exited) is read again here.
    pub(crate) fn finish_fetch(&self, s: StartedFetch) -> Result<()> {
        let StartedFetch { ino, pages, owners, pending } = s;
        let mut err = None;
        let mut again = Vec::new();
        let done = pending.wait();
        crate::aios::completed();
        for (d, own) in done.into_iter().zip(owners) {
            match d.result {
                Ok(()) => {
                    let bufs = d.bufs.into_iter().zip(own.iter().copied());
                    for (buf, i) in bufs.filter(|(_, i)| *i != DISCARD) {
                        let g = pages[i].lock();
                        self.settle_patches(g.patch_bytes());
                        pages[i].complete(g, buf);
                    }
                }
                Err(DevError::Io(libc::ECANCELED)) => {
                    again.extend(own.into_iter().filter(|i| *i != DISCARD).map(|i| pages[i].clone()))
                }
                Err(e) => {
                    let mut failed = false;
                    for i in own.into_iter().filter(|i| *i != DISCARD) {
                        failed |= self.fail_page(ino, &pages[i], true);
                    }
                    // Pages whose writes covered them all were kept: no error for them.
                    if failed {
                        err = Some(Error::from(e));
                    }
                }
            }
        }
        if !again.is_empty() {
            if let Err(e) = self.fetch_chunk(ino, again) {
                err.get_or_insert(e);
            }
        }
        err.map_or(Ok(()), Err)
    }
}
