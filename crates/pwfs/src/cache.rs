//! cache: the page cache for file data.
//!
//! Interface: pages are keyed by (inode, page index) and hold one 4 KiB buffer taken
//! from the device (so the io_uring engine can use its registered arena). A page
//! moves through `Absent → Fetching → UpToDate ⇄ Dirty → Writeback`. A partial write
//! to a page not in memory may instead leave it `Outdated`: no data, only patches
//! (non-blocking writes); resolving it (`Fetching` again) applies the patches in order
//! when the data arrives and leaves it Dirty. Whoever inserts a page in `Fetching`
//! must fill it and call `complete` (waking the threads that `wait` on it) or `fail`. The cache tracks dirty pages in key
//! order for write-back, and evicts clean, idle pages with a CLOCK sweep once it holds
//! more than its capacity.
//!
//! Lock order: the map lock is never held while a page lock is being waited for.

use crate::device::AlignedBuf;
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub type Key = (u64, u64);

/// Keys are (inode, page index): a multiply-xor hash is enough and much cheaper than
/// SipHash on this path (no key comes from an untrusted source).
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type KeyMap<V> = HashMap<Key, V, std::hash::BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    /// Not in memory (a page is only in the map in this state before its fetch starts).
    Absent,
    /// A read from the device is in flight; not readable.
    Fetching,
    /// Only patches, no data yet (non-blocking writes); dirty, never evicted.
    Outdated,
    UpToDate,
    Dirty,
    /// Its buffer is being written; readers and writers wait for the write.
    Writeback,
}

pub struct PageData {
    pub state: PageState,
    /// Present in every readable state.
    pub buf: Option<AlignedBuf>,
    /// Set when the fetch failed; waiters return EIO.
    pub failed: bool,
    /// Writes to a page whose data has not been read yet (non-blocking writes), in
    /// order, applied when the data arrives. Only in `Outdated` and `Fetching`.
    pub patches: Vec<Patch>,
}

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

    /// Bytes held in patches.
    pub fn patch_bytes(&self) -> usize {
        self.patches.iter().map(|p| p.data.len()).sum()
    }

    /// Copy `out.len()` bytes at `offset` from the patches if they cover all of them.
    pub fn read_patches(&self, offset: usize, out: &mut [u8]) -> bool {
        let mut covered = vec![false; out.len()];
        for p in &self.patches {
            let (ps, pe) = (p.offset as usize, p.offset as usize + p.data.len());
            let (s, e) = (ps.max(offset), pe.min(offset + out.len()));
            if s < e {
                out[s - offset..e - offset].copy_from_slice(&p.data[s - ps..e - ps]);
                covered[s - offset..e - offset].iter_mut().for_each(|c| *c = true);
            }
        }
        covered.iter().all(|c| *c)
    }
}

impl PageData {
    pub fn data(&self) -> &[u8] {
        self.buf.as_deref().expect("readable page has a buffer")
    }
    pub fn data_mut(&mut self) -> &mut [u8] {
        self.buf.as_deref_mut().expect("readable page has a buffer")
    }
}

pub struct Page {
    pub key: Key,
    data: Mutex<PageData>,
    cond: Condvar,
    referenced: AtomicBool,
}

impl Page {
    pub fn lock(&self) -> MutexGuard<'_, PageData> {
        self.data.lock()
    }

    /// Wait until the page is readable (its fetch or write-back is done) or its
    /// fetch failed.
    /// An `Outdated` page (patches, no data yet) is returned as it is: the caller adds
    /// a patch, serves a read from the patches, or resolves it.
    pub fn wait(&self) -> MutexGuard<'_, PageData> {
        let mut g = self.lock();
        while g.buf.is_none() && !g.failed && g.state != PageState::Outdated {
            self.cond.wait(&mut g);
        }
        g
    }

    /// Wake the threads waiting on this page (after a state change they look for).
    pub fn notify(&self) {
        self.cond.notify_all();
    }

    /// Lend the buffer of a dirty page to write-back (no copy): until
    /// `end_writeback`, readers and writers of the page wait.
    pub fn begin_writeback(&self) -> Option<AlignedBuf> {
        let mut g = self.lock();
        if g.state != PageState::Dirty {
            return None;
        }
        g.state = PageState::Writeback;
        g.buf.take()
    }

    /// The write is done (or was not needed): the page is clean and readable again.
    pub fn end_writeback(&self, buf: AlignedBuf) {
        let mut g = self.lock();
        g.buf = Some(buf);
        if g.state == PageState::Writeback {
            g.state = PageState::UpToDate;
        }
        drop(g);
        self.cond.notify_all();
    }

    /// The fetch is done: pending patches are applied in order, and the page becomes
    /// readable (Dirty if it had patches) and waiters wake. The caller settles the
    /// accounting of the patches (`g.patch_bytes()`) before, under the same lock, so
    /// that no one who waited for the page sees it readable with its patches still
    /// counted.
    pub fn complete(&self, mut g: MutexGuard<'_, PageData>, mut buf: AlignedBuf) {
        let patches = std::mem::take(&mut g.patches);
        for p in &patches {
            buf[p.offset as usize..p.offset as usize + p.data.len()].copy_from_slice(&p.data);
        }
        g.buf = Some(buf);
        g.state = if patches.is_empty() { PageState::UpToDate } else { PageState::Dirty };
        drop(g);
        self.cond.notify_all();
    }
}

#[derive(Debug, Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
}

struct Map {
    pages: KeyMap<Arc<Page>>,
    clock: VecDeque<Key>,
    dirty: BTreeSet<Key>,
    /// Insertions that skip eviction because the last sweep found nothing to evict.
    skip: usize,
}

pub struct PageCache {
    map: Mutex<Map>,
    capacity: usize,
    pub stats: CacheStats,
}

impl PageCache {
    pub fn new(capacity_pages: usize) -> PageCache {
        PageCache {
            map: Mutex::new(Map { pages: KeyMap::default(), clock: VecDeque::new(), dirty: BTreeSet::new(), skip: 0 }),
            capacity: capacity_pages.max(16),
            stats: CacheStats::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.map.lock().pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dirty_count(&self) -> usize {
        self.map.lock().dirty.len()
    }

    pub fn get(&self, key: Key) -> Option<Arc<Page>> {
        let p = self.map.lock().pages.get(&key).cloned();
        if let Some(p) = &p {
            p.referenced.store(true, Ordering::Relaxed);
        }
        let c = if p.is_some() { &self.stats.hits } else { &self.stats.misses };
        c.fetch_add(1, Ordering::Relaxed);
        p
    }

    /// The page for `key`, inserting it in `Fetching` state if absent. The bool says
    /// whether this call inserted it (and so must fill it).
    pub fn get_or_insert(&self, key: Key) -> (Arc<Page>, bool) {
        self.get_or_insert_range(key.0, key.1, 1).pop().expect("one page")
    }

    /// `get_or_insert` for `n` consecutive pages of `ino`, under one lock.
    pub fn get_or_insert_range(&self, ino: u64, first: u64, n: u64) -> Vec<(Arc<Page>, bool)> {
        self.insert_range(ino, first, n, false)
    }

    /// Pages `first..first + n` of `ino` for readahead: the ones inserted (the bool
    /// says which) are the caller's to fill. Finding a page is not an access of it, and
    /// an inserted page starts referenced, so that the CLOCK sweep passes it over once:
    /// pages read ahead are about to be read, and must not be the first victims while
    /// pages already read (and not read again) wait behind them.
    pub fn read_ahead_range(&self, ino: u64, first: u64, n: u64) -> Vec<(Arc<Page>, bool)> {
        self.insert_range(ino, first, n, true)
    }

    fn insert_range(&self, ino: u64, first: u64, n: u64, ahead: bool) -> Vec<(Arc<Page>, bool)> {
        let mut out = Vec::with_capacity(n as usize);
        let mut m = self.map.lock();
        for idx in first..first + n {
            let key = (ino, idx);
            if let Some(p) = m.pages.get(&key) {
                if !ahead {
                    // Referenced again after it came in: it gets a second chance in the
                    // CLOCK sweep. A page read once (streaming) does not, and goes first.
                    p.referenced.store(true, Ordering::Relaxed);
                    self.stats.hits.fetch_add(1, Ordering::Relaxed);
                }
                out.push((p.clone(), false));
                continue;
            }
            if !ahead {
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
            }
            if m.pages.len() >= self.capacity {
                self.evict(&mut m);
            }
            let page = Arc::new(Page {
                key,
                data: Mutex::new(PageData {
                    state: PageState::Fetching,
                    buf: None,
                    failed: false,
                    patches: Vec::new(),
                }),
                cond: Condvar::new(),
                referenced: AtomicBool::new(ahead),
            });
            m.pages.insert(key, page.clone());
            m.clock.push_back(key);
            out.push((page, true));
        }
        out
    }

    /// A fetch failed: wake the waiters with the error and forget the page.
    pub fn fail(&self, page: &Page) {
        {
            let mut g = page.data.lock();
            g.failed = true;
        }
        page.cond.notify_all();
        let mut m = self.map.lock();
        if m.pages.get(&page.key).is_some_and(|p| std::ptr::eq(&**p, page)) {
            m.pages.remove(&page.key);
        }
    }

    /// `holds` for many pages, under one lock.
    pub fn holds_all<'a>(&self, pages: impl Iterator<Item = &'a Arc<Page>>) -> Vec<bool> {
        let m = self.map.lock();
        pages.map(|page| m.pages.get(&page.key).is_some_and(|p| Arc::ptr_eq(p, page))).collect()
    }

    pub fn mark_dirty(&self, key: Key) {
        self.map.lock().dirty.insert(key);
    }

    /// Mark pages `from..to` of `ino` dirty, under one lock.
    pub fn mark_dirty_range(&self, ino: u64, from: u64, to: u64) {
        let mut m = self.map.lock();
        m.dirty.extend((from..to).map(|i| (ino, i)));
    }

    /// Take the dirty set (in key order); the pages stay in the cache.
    pub fn take_dirty(&self) -> Vec<Arc<Page>> {
        let mut m = self.map.lock();
        let keys = std::mem::take(&mut m.dirty);
        keys.into_iter().filter_map(|k| m.pages.get(&k).cloned()).collect()
    }

    /// Forget every page of `ino` at or past page `from` (truncate, delete).
    /// Returns the pages dropped (the caller settles their patch accounting).
    pub fn drop_from(&self, ino: u64, from: u64) -> Vec<Arc<Page>> {
        let mut m = self.map.lock();
        let keys: Vec<Key> = m.pages.keys().filter(|k| k.0 == ino && k.1 >= from).copied().collect();
        let mut dropped = Vec::with_capacity(keys.len());
        for k in keys {
            dropped.extend(m.pages.remove(&k));
            m.dirty.remove(&k);
        }
        dropped
    }

    /// Drop every clean page (a cold start for benchmarks); dirty pages stay.
    pub fn evict_clean(&self) {
        let mut m = self.map.lock();
        let dirty = m.dirty.clone();
        m.pages.retain(|k, p| {
            dirty.contains(k)
                || Arc::strong_count(p) > 1
                || p.data.try_lock().is_none_or(|g| !matches!(g.state, PageState::UpToDate))
        });
        let Map { pages, clock, .. } = &mut *m;
        clock.retain(|k| pages.contains_key(k));
    }

    /// CLOCK sweep: drop up to a few clean, unreferenced, unshared pages.
    ///
    /// The sweep looks at a bounded number of pages, and when it finds nothing to evict
    /// the next insertions do not sweep at all: when the cache holds mostly pages that
    /// cannot go (dirty, or only patches waiting for their data under Lazy), a sweep of
    /// the whole clock on every insertion cost each write milliseconds under the map
    /// lock (Lazy random 2 KiB writes: 37,000/s until the cache filled, then 370/s).
    /// The cache runs over its capacity meanwhile; write-back brings it back.
    fn evict(&self, m: &mut Map) {
        let target = (self.capacity / 64).max(1);
        if m.skip > 0 {
            m.skip -= 1;
            return;
        }
        let mut freed = 0;
        let mut budget = (m.clock.len() * 2).min((target * 8).max(1024));
        while freed < target && budget > 0 {
            budget -= 1;
            let Some(k) = m.clock.pop_front() else { break };
            let Some(p) = m.pages.get(&k) else { continue };
            let clean = !m.dirty.contains(&k)
                && Arc::strong_count(p) == 1
                && p.data.try_lock().is_some_and(|g| g.state == PageState::UpToDate);
            if !clean {
                m.clock.push_back(k);
                continue;
            }
            if p.referenced.swap(false, Ordering::Relaxed) {
                m.clock.push_back(k);
                continue;
            }
            m.pages.remove(&k);
            freed += 1;
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
        if freed == 0 {
            m.skip = target;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(p: &Page) {
        p.complete(p.lock(), AlignedBuf::new(4096));
    }

    /// A sequential reader with readahead: the pages it has read are the victims when
    /// the cache is full, never the pages read ahead of it that it has not read yet
    /// (evicting those made it fetch them again, one page at a time: 5× slower).
    #[test]
    fn pages_read_ahead_outlive_pages_already_read() {
        let cache = PageCache::new(64);
        // Pages 0..48 were read ahead, then read (each hit once, as a reader does).
        for (p, new) in cache.read_ahead_range(1, 0, 48) {
            assert!(new);
            fill(&p);
        }
        for (p, new) in cache.get_or_insert_range(1, 0, 48) {
            assert!(!new);
            drop(p);
        }
        // The reader is at page 48; readahead brings 48..64 in.
        for (p, _) in cache.read_ahead_range(1, 48, 16) {
            fill(&p);
        }
        assert_eq!(cache.len(), 64);
        // Another file's reads need room.
        for (p, new) in cache.get_or_insert_range(2, 0, 16) {
            assert!(new);
            fill(&p);
        }
        let m = cache.map.lock();
        let ahead_kept = (48..64).filter(|i| m.pages.contains_key(&(1, *i))).count();
        let read_kept = (0..48).filter(|i| m.pages.contains_key(&(1, *i))).count();
        assert_eq!(ahead_kept, 16, "no page read ahead and not yet read was evicted");
        assert_eq!(read_kept, 32, "the oldest pages already read were evicted instead");
        assert!((0..16).all(|i| !m.pages.contains_key(&(1, i))));
    }

    /// A cache full of pages that cannot go (dirty) runs over its capacity instead of
    /// sweeping the whole clock on every insertion, and evicts again once pages are
    /// clean.
    #[test]
    fn a_cache_of_dirty_pages_overflows_and_then_evicts_again() {
        let cache = PageCache::new(64);
        for (p, _) in cache.get_or_insert_range(1, 0, 64) {
            fill(&p);
        }
        cache.mark_dirty_range(1, 0, 64);
        for (p, _) in cache.get_or_insert_range(2, 0, 2) {
            fill(&p);
        }
        assert_eq!(cache.len(), 66, "nothing could be evicted");
        drop(cache.take_dirty()); // written back: clean now
        for (p, _) in cache.get_or_insert_range(2, 2, 4) {
            fill(&p);
        }
        assert_eq!(cache.len(), 66, "every insertion after the skip evicted a page");
        assert_eq!(cache.stats.evictions.load(Ordering::Relaxed), 4);
    }

    /// Readahead finding a page in the cache is not an access: a page read once and
    /// then passed over by readahead is still the first to go.
    #[test]
    fn readahead_over_a_cached_page_does_not_reference_it() {
        let cache = PageCache::new(16);
        for (p, _) in cache.get_or_insert_range(1, 0, 16) {
            fill(&p);
        }
        drop(cache.read_ahead_range(1, 0, 16));
        for (p, _) in cache.get_or_insert_range(2, 0, 1) {
            fill(&p);
        }
        assert!(!cache.map.lock().pages.contains_key(&(1, 0)), "page 0 was the victim");
        let s = &cache.stats;
        assert_eq!((s.hits.load(Ordering::Relaxed), s.misses.load(Ordering::Relaxed)), (0, 17));
    }
}
