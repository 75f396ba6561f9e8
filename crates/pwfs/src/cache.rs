//! cache: the page cache for file data.
//!
//! Interface: pages are keyed by (inode, page index) and hold one 4 KiB buffer taken
//! from the device (so the io_uring engine can use its registered arena). A page
//! moves through `Fetching → UpToDate ⇄ Dirty → Writeback`. A partial write
//! to a page not in memory may instead leave it `Outdated`: no data, only patches
//! (non-blocking writes); resolving it (`Fetching` again) applies the patches in order
//! when the data arrives and leaves it Dirty. Whoever inserts a page in `Fetching`
//! must fill it and call `complete` (waking the threads that `wait` on it) or `fail`. The cache tracks dirty pages in key
//! order for write-back, and evicts clean, idle pages with a CLOCK sweep once it holds
//! more than its capacity.
//!
//! Lock order: the map lock is never held while a page lock is being waited for.

use crate::device::AlignedBuf;
use crate::lock::PerCpuRwLock;
use crate::nbw::Patch;
use crossbeam_utils::CachePadded;
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

pub type Key = (u64, u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
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
    /// Its key is in the cache's dirty set: set under the dirty set's lock by
    /// `mark_dirty_range`, cleared as the key leaves it while the page is the cache's
    /// (and when its fetch fails). Never set while the key is not listed (it may be
    /// clear while it is), so a writer that dirtied the page and then sees it set need
    /// not list it again: whoever took the key out (write-back) locks the page after
    /// taking it, and so sees the writer's change.
    listed: AtomicBool,
}

impl Page {
    /// An access: the CLOCK sweep gives the page a second chance. The flag is read
    /// first, so that threads reading a hot page share its cache line instead of
    /// taking it from each other with a store that changes nothing.
    fn touch(&self) {
        if !self.referenced.load(Ordering::Relaxed) {
            self.referenced.store(true, Ordering::Relaxed);
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, PageData> {
        self.data.lock()
    }

    /// The page's lock if no one holds it.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, PageData>> {
        self.data.try_lock()
    }

    /// Whether the page's key is in the dirty set now (see `listed`).
    pub fn listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
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
        self.return_buffer(buf, PageState::UpToDate);
    }

    /// The write was not made (the page lies past the end of file while the write
    /// that extends the file finishes): the page gets its buffer back and stays dirty.
    /// The caller marks it dirty in the cache again (`PageCache::mark_dirty_if_held`).
    pub fn abort_writeback(&self, buf: AlignedBuf) {
        self.return_buffer(buf, PageState::Dirty);
    }

    /// A page lent to write-back gets its buffer back, in `state` unless it left
    /// Writeback meanwhile, and its waiters wake.
    fn return_buffer(&self, buf: AlignedBuf, state: PageState) {
        let mut g = self.lock();
        g.buf = Some(buf);
        if g.state == PageState::Writeback {
            g.state = state;
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
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    /// Pages dropped behind a stream another cache keeps (`drop_behind`).
    pub dropped_behind: AtomicU64,
}

#[derive(Default)]
struct Map {
    pages: BTreeMap<Key, Arc<Page>>,
    /// The CLOCK order. A page dropped (truncate, delete, a failed fetch) leaves its
    /// key here, and one inserted again has two: `push_clock` keeps the queue within
    /// twice the pages.
    clock: VecDeque<Key>,
    /// Insertions that skip eviction because the last sweep found nothing to evict.
    skip: usize,
}

impl Map {
    fn push_clock(&mut self, key: Key) {
        self.clock.push_back(key);
        if self.clock.len() > 2 * self.pages.len() + 64 {
            // Amortised: at least as many pushes again before the next compaction.
            // The last entry of a key is its place (it was inserted again there).
            let mut seen = std::collections::HashSet::with_capacity(self.pages.len());
            let mut kept: Vec<Key> =
                self.clock.iter().rev().filter(|k| self.pages.contains_key(k) && seen.insert(**k)).copied().collect();
            kept.reverse();
            self.clock = kept.into();
        }
    }
}

/// One shard of the cache: its pages and clock, its dirty set and its counters, on
/// cache lines of their own so that threads working in different shards share
/// nothing. The pages are under a lock sharded by CPU: a hit (a read, or a write to a
/// cached page) takes its CPU's shard only, so threads on two CPUs finding pages of
/// one shard do not pass its lock's cache line back and forth; an insertion or a drop
/// takes every CPU's. The dirty set has a lock of its own, taken after the pages'
/// when both are held.
struct Shard {
    map: PerCpuRwLock<Map>,
    dirty: CachePadded<Mutex<BTreeSet<Key>>>,
    stats: CachePadded<CacheStats>,
}

/// Pages go to shards by (inode, page index / 16): a sequential run of up to 16
/// pages is one lock, and threads on different parts of a file, or on different
/// files, mostly take different locks. Pages are ordered by key within a shard, so
/// the pages of one inode past an index (truncate, delete) are a range in each.
const GROUP_SHIFT: u32 = 4;

pub struct PageCache {
    shards: Box<[Shard]>,
    /// Hits, counted per CPU (a hit writes no line another CPU's hit writes).
    hits: [CachePadded<AtomicU64>; crate::lock::MAX_SHARDS],
    capacity: usize,
    /// Capacity of each shard (the cache's divided evenly).
    shard_capacity: usize,
    pages: AtomicUsize,
    dirty: AtomicUsize,
}

impl PageCache {
    pub fn new(capacity_pages: usize) -> PageCache {
        let capacity = capacity_pages.max(16);
        // At least 256 pages a shard, so that an uneven spread of keys does not evict
        // early; a small cache is one shard (one CLOCK over everything).
        let n = (capacity / 256).clamp(1, 64);
        let shards = (0..n)
            .map(|_| Shard { map: Default::default(), dirty: Default::default(), stats: Default::default() })
            .collect();
        PageCache {
            shards,
            hits: Default::default(),
            capacity,
            shard_capacity: capacity / n,
            pages: AtomicUsize::new(0),
            dirty: AtomicUsize::new(0),
        }
    }

    fn shard_of(&self, key: Key) -> usize {
        if self.shards.len() == 1 {
            return 0;
        }
        let h = (key.0.rotate_left(17) ^ (key.1 >> GROUP_SHIFT)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (h >> 32) as usize % self.shards.len()
    }

    fn shard(&self, key: Key) -> &Shard {
        &self.shards[self.shard_of(key)]
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.pages.load(Ordering::Relaxed)
    }

    pub fn dirty_count(&self) -> usize {
        self.dirty.load(Ordering::Relaxed)
    }

    fn sum(&self, f: fn(&CacheStats) -> &AtomicU64) -> u64 {
        self.shards.iter().map(|s| f(&s.stats).load(Ordering::Relaxed)).sum()
    }

    /// Whether the page at `key` can leave the cache: up to date (no patches, no fetch
    /// in flight, not failed), not dirty, and held by no one but the map. The caller
    /// holds the shard's map lock for writing and `dirty` (its dirty set).
    fn evictable(key: &Key, page: &Arc<Page>, dirty: &BTreeSet<Key>) -> bool {
        !dirty.contains(key)
            && Arc::strong_count(page) == 1
            && page.data.try_lock().is_some_and(|g| g.state == PageState::UpToDate)
    }

    /// Hits, misses and evictions (by the CLOCK sweep) so far.
    pub fn stats(&self) -> (u64, u64, u64) {
        let hits = self.hits.iter().map(|h| h.load(Ordering::Relaxed)).sum();
        (hits, self.sum(|s| &s.misses), self.sum(|s| &s.evictions))
    }

    /// Pages dropped behind streams so far (`drop_behind`).
    pub fn dropped_behind(&self) -> u64 {
        self.sum(|s| &s.dropped_behind)
    }

    /// Whether the page is in the cache now (tests).
    #[cfg(test)]
    pub fn contains(&self, key: Key) -> bool {
        self.shard(key).map.read().pages.contains_key(&key)
    }

    pub fn get(&self, key: Key) -> Option<Arc<Page>> {
        let shard = self.shard(key);
        let m = shard.map.read();
        let (p, slot) = (m.pages.get(&key).cloned(), m.slot());
        drop(m);
        match &p {
            Some(p) => {
                p.touch();
                self.hit(slot, 1);
            }
            None => {
                shard.stats.misses.fetch_add(1, Ordering::Relaxed);
            }
        }
        p
    }

    /// Pages `first..first + n` of `ino` that are in the cache (an access of each),
    /// a shard lock per group; nothing is inserted. Misses are counted by the
    /// `get_or_insert` that follows them.
    pub fn lookup_range(&self, ino: u64, first: u64, n: u64) -> Vec<Option<Arc<Page>>> {
        let mut out = Vec::with_capacity(n as usize);
        let mut idx = first;
        while idx < first + n {
            let end = (((idx >> GROUP_SHIFT) + 1) << GROUP_SHIFT).min(first + n);
            let m = self.shard((ino, idx)).map.read();
            let slot = m.slot();
            let mut hits = 0;
            for idx in idx..end {
                let p = m.pages.get(&(ino, idx)).cloned();
                if let Some(p) = &p {
                    p.touch();
                    hits += 1;
                }
                out.push(p);
            }
            drop(m);
            self.hit(slot, hits);
            idx = end;
        }
        out
    }

    /// Whether pages `first..first + pages.len()` of `ino` in the cache are these very
    /// pages (none dropped or replaced since they were found). Not an access of them.
    pub fn holds(&self, ino: u64, first: u64, pages: &[Arc<Page>]) -> bool {
        pages
            .iter()
            .zip(first..)
            .all(|(p, idx)| self.shard((ino, idx)).map.read().pages.get(&(ino, idx)).is_some_and(|q| Arc::ptr_eq(p, q)))
    }

    fn hit(&self, slot: usize, n: u64) {
        if n > 0 {
            self.hits[slot].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The page for `key`, inserting it in `Fetching` state if absent. The bool says
    /// whether this call inserted it (and so must fill it).
    pub fn get_or_insert(&self, key: Key) -> (Arc<Page>, bool) {
        self.get_or_insert_range(key.0, key.1, 1).pop().expect("one page")
    }

    /// `get_or_insert` for `n` consecutive pages of `ino`, a shard lock per group.
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
        let mut idx = first;
        while idx < first + n {
            // The rest of this group of pages, under its shard's lock.
            let group_end = ((idx >> GROUP_SHIFT) + 1) << GROUP_SHIFT;
            let end = group_end.min(first + n);
            let shard = self.shard((ino, idx));
            // Pages already here are found under this CPU's share of the lock.
            let before = out.len();
            let slot = {
                let m = shard.map.read();
                for i in idx..end {
                    match m.pages.get(&(ino, i)) {
                        Some(p) => out.push((p.clone(), false)),
                        None => break,
                    }
                }
                m.slot()
            };
            let found = (out.len() - before) as u64;
            if !ahead {
                // Referenced again after it came in: it gets a second chance in the
                // CLOCK sweep. A page read once (streaming) does not, and goes first.
                out[before..].iter().for_each(|(p, _)| p.touch());
                self.hit(slot, found);
            }
            if idx + found == end {
                idx = end;
                continue;
            }
            // The rest, inserted where missing, under the whole lock.
            let idx_missing = idx + found;
            let mut m = shard.map.write();
            for idx in idx_missing..end {
                let key = (ino, idx);
                if let Some(p) = m.pages.get(&key) {
                    if !ahead {
                        p.touch();
                        self.hit(slot, 1);
                    }
                    out.push((p.clone(), false));
                    continue;
                }
                if !ahead {
                    shard.stats.misses.fetch_add(1, Ordering::Relaxed);
                }
                if m.pages.len() >= self.shard_capacity {
                    self.evict(shard, &mut m);
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
                    listed: AtomicBool::new(false),
                });
                m.pages.insert(key, page.clone());
                self.pages.fetch_add(1, Ordering::Relaxed);
                m.push_clock(key);
                out.push((page, true));
            }
            idx = end;
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
        let shard = self.shard(page.key);
        let mut m = shard.map.write();
        if m.pages.get(&page.key).is_some_and(|p| std::ptr::eq(&**p, page)) {
            m.pages.remove(&page.key);
            self.pages.fetch_sub(1, Ordering::Relaxed);
            // Its key leaves the dirty set too (a page of that key made later is
            // listed by its own writer): a stale key would count as dirty until the
            // file's next write-back.
            let mut d = shard.dirty.lock();
            if d.remove(&page.key) {
                self.dirty.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // Under the map's write lock, after the removal: no writer lists the page
        // (`mark_dirty_range` holds the map's read lock) and sets the flag again.
        page.listed.store(false, Ordering::Release);
    }

    /// Whether each page is still the cache's page for its key.
    pub fn holds_all<'a>(&self, pages: impl Iterator<Item = &'a Arc<Page>>) -> Vec<bool> {
        pages
            .map(|page| self.shard(page.key).map.read().pages.get(&page.key).is_some_and(|p| Arc::ptr_eq(p, page)))
            .collect()
    }

    /// `mark_dirty` for this page, if it is still the cache's page for its key (a
    /// page dropped meanwhile, by a truncate or a delete, is not listed again).
    pub fn mark_dirty_if_held(&self, page: &Arc<Page>) {
        let shard = self.shard(page.key);
        let m = shard.map.read();
        if m.pages.get(&page.key).is_some_and(|p| Arc::ptr_eq(p, page)) {
            // Counted under the set's lock (see `mark_dirty`).
            let mut d = shard.dirty.lock();
            if d.insert(page.key) {
                self.dirty.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn mark_dirty(&self, key: Key) {
        // Counted under the set's lock, as `take_dirty` uncounts: a take between the
        // insert and the count would make the count wrap.
        let mut d = self.shard(key).dirty.lock();
        if d.insert(key) {
            self.dirty.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Mark pages `from..to` of `ino` dirty, a shard lock per group.
    pub fn mark_dirty_range(&self, ino: u64, from: u64, to: u64) {
        let mut idx = from;
        while idx < to {
            let end = (((idx >> GROUP_SHIFT) + 1) << GROUP_SHIFT).min(to);
            let shard = self.shard((ino, idx));
            let m = shard.map.read();
            let mut d = shard.dirty.lock();
            let mut added = 0;
            for i in idx..end {
                added += d.insert((ino, i)) as usize;
                if let Some(p) = m.pages.get(&(ino, i)) {
                    p.listed.store(true, Ordering::Release);
                }
            }
            // Counted under the set's lock (see `mark_dirty`).
            if added > 0 {
                self.dirty.fetch_add(added, Ordering::Relaxed);
            }
            drop(d);
            drop(m);
            idx = end;
        }
    }

    /// The dirty pages (of the inodes in `inos`, or all), left dirty.
    pub fn dirty_pages(&self, inos: Option<&BTreeSet<u64>>) -> Vec<Arc<Page>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let m = shard.map.read();
            let d = shard.dirty.lock();
            match inos {
                None => out.extend(d.iter().filter_map(|k| m.pages.get(k).cloned())),
                Some(inos) => {
                    for ino in inos {
                        let keys = d.range((*ino, 0)..=(*ino, u64::MAX));
                        out.extend(keys.filter_map(|k| m.pages.get(k).cloned()));
                    }
                }
            }
        }
        out
    }

    /// Take the dirty set (in key order); the pages stay in the cache.
    pub fn take_dirty(&self) -> Vec<Arc<Page>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let m = shard.map.read();
            let mut d = shard.dirty.lock();
            let keys = std::mem::take(&mut *d);
            self.dirty.fetch_sub(keys.len(), Ordering::Relaxed);
            for k in keys {
                if let Some(p) = m.pages.get(&k) {
                    p.listed.store(false, Ordering::Release);
                    out.push(p.clone());
                }
            }
            drop(d);
        }
        if self.shards.len() > 1 {
            out.sort_unstable_by_key(|p| p.key);
        }
        out
    }

    /// The dirty pages of each inode that has some (one step per page; `dirty_inodes`
    /// takes one per inode, for callers that need no count).
    pub fn dirty_by_inode(&self) -> std::collections::BTreeMap<u64, usize> {
        let mut out = std::collections::BTreeMap::new();
        for shard in self.shards.iter() {
            for (ino, _) in shard.dirty.lock().iter() {
                *out.entry(*ino).or_insert(0) += 1;
            }
        }
        out
    }

    /// The inodes that have dirty pages now.
    pub fn dirty_inodes(&self) -> BTreeSet<u64> {
        let mut out = BTreeSet::new();
        for shard in self.shards.iter() {
            let d = shard.dirty.lock();
            // One step per inode, not per dirty page.
            let mut from = (0, 0);
            while let Some(&(ino, _)) = d.range(from..).next() {
                out.insert(ino);
                match ino.checked_add(1) {
                    Some(next) => from = (next, 0),
                    None => break,
                }
            }
        }
        out
    }

    /// `take_dirty` for the pages of the inodes in `inos` only.
    ///
    /// Each shard's dirty set is walked once when it is the smaller side, and looked up
    /// per inode otherwise: a write-back of many small files (a file server's) made
    /// a range query per inode in every shard, most of them empty (64 shards × a few
    /// hundred inodes a round: 2% of both CPUs in the fileserver-like workload).
    pub fn take_dirty_of(&self, inos: &BTreeSet<u64>) -> Vec<Arc<Page>> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let m = shard.map.read();
            let mut d = shard.dirty.lock();
            if d.is_empty() {
                continue;
            }
            let keys: Vec<Key> = if d.len() <= 4 * inos.len() {
                d.iter().filter(|k| inos.contains(&k.0)).copied().collect()
            } else {
                inos.iter().flat_map(|ino| d.range((*ino, 0)..=(*ino, u64::MAX))).copied().collect()
            };
            for k in keys {
                d.remove(&k);
                self.dirty.fetch_sub(1, Ordering::Relaxed);
                if let Some(p) = m.pages.get(&k) {
                    p.listed.store(false, Ordering::Release);
                    out.push(p.clone());
                }
            }
        }
        out.sort_unstable_by_key(|p| p.key);
        out
    }

    /// Drop-behind: forget the pages `first..first + n` of `ino` that nothing else
    /// needs (`evictable`: what the CLOCK sweep would evict), once
    /// a sequential reader has handed them to a cache of its own (the kernel's page
    /// cache of a FUSE mount). Kept, they would only wait for the CLOCK sweep, whose
    /// visit of a cold page costs a cache miss or two, while holding room that data
    /// only this cache has could use. Returns how many went.
    pub fn drop_behind(&self, ino: u64, first: u64, n: u64) -> usize {
        let mut dropped = 0;
        let mut idx = first;
        while idx < first + n {
            let end = (((idx >> GROUP_SHIFT) + 1) << GROUP_SHIFT).min(first + n);
            let shard = self.shard((ino, idx));
            let mut m = shard.map.write();
            let dirty = shard.dirty.lock();
            let mut here = 0;
            for key in (idx..end).map(|i| (ino, i)) {
                let idle = m.pages.get(&key).is_some_and(|p| Self::evictable(&key, p, &dirty));
                if let Some(p) = idle.then(|| m.pages.remove(&key)).flatten() {
                    p.listed.store(false, Ordering::Release);
                    here += 1;
                }
            }
            shard.stats.dropped_behind.fetch_add(here as u64, Ordering::Relaxed);
            dropped += here;
            idx = end;
        }
        self.pages.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    /// Forget every page of `ino` at or past page `from` and before `end` (the caller
    /// knows that no page at or past `end` was ever inserted: truncate, delete).
    /// Returns the pages dropped (the caller settles their patch accounting). Only the
    /// shards that can hold those pages are visited: a small file's are one.
    pub fn drop_from(&self, ino: u64, from: u64, end: u64) -> Vec<Arc<Page>> {
        self.drop_keys(ino, from, end, u64::MAX)
    }

    /// Drop the pages of `ino` in `from..to`, dirty or not (punch hole, zero, collapse
    /// and insert range); returns them. Pages at or past the inode's `pages_end` are
    /// never there: `to` may be capped at it.
    pub fn drop_range(&self, ino: u64, from: u64, to: u64) -> Vec<Arc<Page>> {
        self.drop_keys(ino, from, to, to)
    }

    /// Drop the pages with keys in `from..to` from the shards that hold pages
    /// `from..end` of `ino`.
    fn drop_keys(&self, ino: u64, from: u64, end: u64, to: u64) -> Vec<Arc<Page>> {
        let mut dropped = Vec::new();
        if from >= end {
            return dropped;
        }
        let groups = (end - 1) / (1 << GROUP_SHIFT) - from / (1 << GROUP_SHIFT) + 1;
        let visit: Vec<usize> = if groups >= self.shards.len() as u64 {
            (0..self.shards.len()).collect()
        } else {
            let mut v: Vec<usize> = (from >> GROUP_SHIFT..=(end - 1) >> GROUP_SHIFT)
                .map(|g| self.shard_of((ino, g << GROUP_SHIFT)))
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        for shard in visit.into_iter().map(|i| &self.shards[i]) {
            let mut m = shard.map.write();
            let mut d = shard.dirty.lock();
            let keys: Vec<Key> = m.pages.range((ino, from)..(ino, to)).map(|(k, _)| *k).collect();
            // (With `to` u64::MAX, the last page index is never used: indexes stay below 2^32.)
            for k in keys {
                if let Some(p) = m.pages.remove(&k) {
                    p.listed.store(false, Ordering::Release);
                    dropped.push(p);
                }
                if d.remove(&k) {
                    self.dirty.fetch_sub(1, Ordering::Relaxed);
                }
            }
            // Dirty keys whose page is gone already.
            let gone: Vec<Key> = d.range((ino, from)..(ino, to)).copied().collect();
            for k in gone {
                d.remove(&k);
                self.dirty.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.pages.fetch_sub(dropped.len(), Ordering::Relaxed);
        dropped
    }

    /// Drop every clean page (a cold start for benchmarks); dirty pages stay.
    pub fn evict_clean(&self) {
        for shard in self.shards.iter() {
            let mut m = shard.map.write();
            let dirty = shard.dirty.lock();
            let Map { pages, clock, .. } = &mut *m;
            let before = pages.len();
            pages.retain(|k, p| !Self::evictable(k, p, &dirty));
            self.pages.fetch_sub(before - pages.len(), Ordering::Relaxed);
            clock.retain(|k| pages.contains_key(k));
        }
    }

    /// CLOCK sweep of one shard: drop up to a few clean, unreferenced, unshared pages.
    ///
    /// The sweep looks at a bounded number of pages, and when it finds nothing to evict
    /// the next insertions do not sweep at all: when the cache holds mostly pages that
    /// cannot go (dirty, or only patches waiting for their data under Lazy), a sweep of
    /// the whole clock on every insertion cost each write milliseconds under the map
    /// lock (Lazy random 2 KiB writes: 37,000/s until the cache filled, then 370/s).
    /// The cache runs over its capacity meanwhile; write-back brings it back.
    fn evict(&self, shard: &Shard, m: &mut Map) {
        let target = (self.shard_capacity / 64).max(1);
        if m.skip > 0 {
            m.skip -= 1;
            return;
        }
        let mut freed = 0;
        // Sized to the shard: a shard of 256 pages looked at 1,024 entries on every
        // fourth insertion while it held only pages that cannot go (patches under
        // Lazy): 18% of all CPU time in a random-write benchmark.
        let mut budget = (m.clock.len() * 2).min((2 * self.shard_capacity).clamp(64, 1024));
        let dirty = shard.dirty.lock();
        while freed < target && budget > 0 {
            budget -= 1;
            let Some(k) = m.clock.pop_front() else { break };
            let Some(p) = m.pages.get(&k) else {
                // The key of a page dropped since: costs nothing of the budget.
                budget += 1;
                continue;
            };
            if !Self::evictable(&k, p, &dirty) {
                m.clock.push_back(k);
                continue;
            }
            if p.referenced.swap(false, Ordering::Relaxed) {
                m.clock.push_back(k);
                continue;
            }
            m.pages.remove(&k);
            self.pages.fetch_sub(1, Ordering::Relaxed);
            freed += 1;
            shard.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
        if freed == 0 {
            m.skip = target * 8;
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
        let ahead_kept = (48..64).filter(|i| cache.contains((1, *i))).count();
        let read_kept = (0..48).filter(|i| cache.contains((1, *i))).count();
        assert_eq!(ahead_kept, 16, "no page read ahead and not yet read was evicted");
        assert_eq!(read_kept, 32, "the oldest pages already read were evicted instead");
        assert!((0..16).all(|i| !cache.contains((1, i))));
    }

    /// Files written and deleted over and over while the cache is not full: the
    /// CLOCK queue keeps no more than about twice the pages, not a key for every page
    /// ever dropped (it grew without end, and its stale keys then used up every
    /// sweep's budget, so the cache ran over its size).
    #[test]
    fn dropped_pages_leave_no_keys_behind() {
        let cache = PageCache::new(4096);
        let queued = |c: &PageCache| c.shards.iter().map(|s| s.map.read().clock.len()).sum::<usize>();
        for round in 0..2000u64 {
            for (p, _) in cache.get_or_insert_range(round % 7, 0, 16) {
                fill(&p);
            }
            drop(cache.drop_range(round % 7, 0, u64::MAX));
            // The same file read and dropped, read again: one key, not two.
            for (p, _) in cache.get_or_insert_range(100, round % 16, 1) {
                fill(&p);
            }
        }
        let pages = cache.len();
        assert!(queued(&cache) <= 2 * pages + 64 * cache.shards.len(), "{} keys for {pages} pages", queued(&cache));
        // And the sweep still evicts once the cache is full.
        for first in (0..8192).step_by(16) {
            for (p, _) in cache.get_or_insert_range(200, first, 16) {
                fill(&p);
            }
        }
        assert!(cache.len() <= 4096 + 64 * cache.shards.len(), "{} pages in a cache of 4096", cache.len());
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
        // Written back: clean now. The fruitless sweep set a skip of 8 insertions, one
        // of them used above.
        drop(cache.take_dirty());
        for (p, _) in cache.get_or_insert_range(2, 2, 7 + 4) {
            fill(&p);
        }
        assert_eq!(cache.len(), 66 + 7, "every insertion after the skip evicted a page");
        assert_eq!(cache.stats().2, 4);
    }

    /// A page is marked listed while its key is in the dirty set, and never after the
    /// key left it (taken by write-back, or the page dropped): a writer that sees the
    /// mark may skip listing the page again.
    #[test]
    fn listed_follows_the_dirty_set() {
        let cache = PageCache::new(256);
        let pages: Vec<Arc<Page>> = cache.get_or_insert_range(1, 0, 4).into_iter().map(|(p, _)| p).collect();
        pages.iter().for_each(|p| fill(p));
        assert!(pages.iter().all(|p| !p.listed()), "a new page is not listed");
        cache.mark_dirty_range(1, 0, 2);
        assert_eq!(pages.iter().map(|p| p.listed()).collect::<Vec<_>>(), [true, true, false, false]);
        let taken: Vec<Key> = cache.take_dirty().iter().map(|p| p.key).collect();
        assert_eq!(taken, [(1, 0), (1, 1)]);
        assert!(pages.iter().all(|p| !p.listed()), "taken by write-back: no longer listed");
        cache.mark_dirty_range(1, 0, 4);
        let of: BTreeSet<u64> = [1].into();
        assert_eq!(cache.take_dirty_of(&of).len(), 4);
        assert!(pages.iter().all(|p| !p.listed()));
        cache.mark_dirty_range(1, 2, 4);
        assert_eq!(cache.drop_from(1, 3, 4).len(), 1);
        assert!(!pages[3].listed(), "dropped: no longer listed");
        assert!(pages[2].listed());
        assert_eq!(cache.dirty_count(), 1);
    }

    /// `take_dirty_of` takes exactly the dirty pages of the inodes asked for, whether
    /// it walks a shard's dirty set (few dirty pages, many inodes asked) or looks each
    /// inode up (many dirty pages, few inodes asked), and leaves the others dirty.
    #[test]
    fn take_dirty_of_takes_the_inodes_asked_for_either_way() {
        let cache = PageCache::new(16 * 256);
        assert!(cache.shards.len() > 1);
        // Inodes 1..=40 with 3 dirty pages each, inode 100 with 600.
        for ino in (1..=40).chain([100]) {
            let n = if ino == 100 { 600 } else { 3 };
            cache.get_or_insert_range(ino, 0, n).into_iter().for_each(|(p, _)| fill(&p));
            cache.mark_dirty_range(ino, 0, n);
        }
        let keys = |v: Vec<Arc<Page>>| v.iter().map(|p| p.key).collect::<Vec<Key>>();
        // Many inodes asked, some with nothing dirty (200, 300).
        let many: BTreeSet<u64> = (1..=30).chain([200, 300]).collect();
        let want: Vec<Key> = (1..=30).flat_map(|ino| (0..3).map(move |i| (ino, i))).collect();
        assert_eq!(keys(cache.take_dirty_of(&many)), want);
        // One inode asked among many dirty pages.
        let one: BTreeSet<u64> = [100].into();
        assert_eq!(keys(cache.take_dirty_of(&one)), (0..600).map(|i| (100, i)).collect::<Vec<Key>>());
        assert_eq!(cache.dirty_count(), 10 * 3);
        assert_eq!(
            keys(cache.take_dirty()),
            (31..=40).flat_map(|ino| (0..3).map(move |i| (ino, i))).collect::<Vec<Key>>()
        );
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
        assert!(!cache.contains((1, 0)), "page 0 was the victim");
        let (hits, misses, _) = cache.stats();
        assert_eq!((hits, misses), (0, 17));
    }

    /// A large cache is sharded: pages of one file spread over shards, and truncate,
    /// dirty accounting and write-back order still see the file as a whole.
    #[test]
    fn a_sharded_cache_keeps_counts_and_key_order() {
        let cache = PageCache::new(64 * 256);
        assert!(cache.shards.len() > 1);
        for ino in 1..4 {
            for (p, new) in cache.get_or_insert_range(ino, 0, 500) {
                assert!(new);
                fill(&p);
            }
        }
        assert_eq!(cache.len(), 1500);
        cache.mark_dirty_range(2, 10, 300);
        cache.mark_dirty_range(2, 250, 400);
        cache.mark_dirty((3, 7));
        assert_eq!(cache.dirty_count(), 390 + 1);
        assert!(cache.drop_from(2, 500, 500).is_empty());
        let dropped = cache.drop_from(2, 200, 500);
        assert_eq!(dropped.len(), 300);
        assert_eq!(cache.len(), 1200);
        assert_eq!(cache.dirty_count(), 190 + 1);
        assert!(cache.contains((2, 199)) && !cache.contains((2, 200)) && cache.contains((1, 499)));
        let keys: Vec<Key> = cache.take_dirty().iter().map(|p| p.key).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted, "write-back gets the dirty pages in key order");
        assert_eq!(keys.len(), 191);
        assert_eq!(cache.dirty_count(), 0);
    }
}
