//! journal: physical redo journal for metadata (and for the data blocks hitchhiking
//! carries), ordered mode for the rest of the data.
//!
//! Interface: the file-system layer collects the images of the metadata blocks a
//! transaction changed, the data blocks `hitchhike` carries (with their deltas), and
//! the blocks it freed or wrote home (revokes); after the data those blocks refer to
//! is on the device, it starts the transaction ([`Journal::start`]) and finishes it
//! ([`Journal::finish`], or `commit_after` on the synchronous stack). A block whose
//! previous contents the log holds may go as a delta (XOR, LZ4) in the commit block
//! instead of an image; a transaction of deltas only is its commit block alone. Only
//! after the commit block is durable is the transaction. Committed contents are kept
//! until a [`Journal::checkpoint`] writes them home and advances the journal header.
//! [`scan`] and [`plan`] read a journal back after a crash; replay is idempotent
//! because it only ever writes whole committed contents (images, and deltas applied
//! to contents the log itself gives), newest last, skipping blocks a later (or the
//! same) transaction revoked.
//!
//! The log restarts at its first block after every checkpoint (a circular log that
//! is always emptied before it wraps); see docs/FORMAT.md for the crash cases.

use crate::device::{AlignedBuf, Device, Op, OpKind};
use crate::error::{Error, Result};
use crate::format::{
    journal_escape, journal_needs_escape, JournalCommit, JournalDelta, JournalDesc, JournalHeader, Superblock, BLOCK,
    BLOCK_SIZE, JCOMMIT_EXTRA_MAX, JDELTA_HEADER, JDESC_ENTRIES, JTAG_ESCAPED,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub struct Journal {
    header_block: u64,
    /// First block of the log and its length in blocks.
    log_start: u64,
    log_len: u64,
    /// Next free log position (relative to log_start).
    pos: u64,
    /// Sequence number of the next transaction.
    next_seq: u64,
    /// Committed contents (images, and the results of deltas) not yet written home.
    pending: BTreeMap<u64, Arc<AlignedBuf>>,
    /// Carry changed blocks as deltas of their logged contents (mechanism 3).
    deltas: bool,
    pub stats: JournalStats,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct JournalStats {
    pub commits: u64,
    pub checkpoints: u64,
    pub blocks_logged: u64,
    /// Commits that wrote nothing but their commit block.
    pub commit_only: u64,
    /// Blocks carried as deltas, summed over commits.
    pub deltas: DeltaCounts,
}

/// A transaction whose descriptor and image blocks are on their way to the log
/// ([`Journal::start`]); dropping it waits for them and commits nothing.
pub struct StartedCommit {
    body: crate::device::Pending,
    commit: JournalCommit,
    /// Byte offset of the commit block.
    commit_at: u64,
    n_body: u64,
    /// The new contents of every block this transaction logs (as image or delta).
    logged: Vec<(u64, Arc<AlignedBuf>)>,
    revokes: Vec<u64>,
    deltas: DeltaCounts,
}

/// One transaction ready to commit.
pub struct Transaction {
    /// Metadata blocks, whole. With deltas on, one whose previous contents the log
    /// holds may be carried as a delta of them instead.
    pub images: Vec<(u64, AlignedBuf)>,
    pub revokes: Vec<u64>,
    /// Data blocks whose small synchronous writes ride in this commit (hitchhiking,
    /// mechanism 3), each with the delta `hitchhike` made, if any; one without (or
    /// whose delta does not fit) is logged whole.
    pub data: Vec<DataBlock>,
    /// Carried blocks this commit writes home whole, in place (retired): revoked.
    pub retired: Vec<u64>,
}

/// A data block carried by the journal (see `hitchhike.rs`).
pub struct DataBlock {
    pub block: u64,
    pub content: Arc<AlignedBuf>,
    pub delta: Option<JournalDelta>,
}

/// What one commit carried as deltas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeltaCounts {
    /// Metadata blocks carried as deltas instead of images.
    pub meta: u64,
    /// Data blocks carried as deltas.
    pub data: u64,
    /// Data blocks logged whole (no delta, or it did not fit).
    pub data_images: u64,
    /// Bytes of delta records written.
    pub bytes: u64,
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.images.is_empty() && self.revokes.is_empty() && self.data.is_empty() && self.retired.is_empty()
    }
    /// The data blocks it carries, with their new contents.
    pub fn logged_data(&self) -> Vec<(u64, Arc<AlignedBuf>)> {
        self.data.iter().map(|d| (d.block, d.content.clone())).collect()
    }
    /// Log blocks this transaction needs at most (every block logged whole).
    pub fn log_blocks(&self) -> u64 {
        let entries = self.images.len() + self.data.len() + self.revokes.len() + self.retired.len();
        (entries.div_ceil(JDESC_ENTRIES)).max(1) as u64 + (self.images.len() + self.data.len()) as u64 + 1
    }
}

/// The XOR of `new` with `base` (all zeros if None), LZ4-compressed, if that is at
/// most `limit` bytes. Both blocks are whole 4 KiB blocks.
pub fn make_delta(block: u64, new: &[u8], base: Option<&[u8]>, limit: usize) -> Option<JournalDelta> {
    let mut x = [0u8; BLOCK_SIZE];
    match base {
        Some(b) => {
            for ((o, n), b) in x.iter_mut().zip(new).zip(b) {
                *o = n ^ b;
            }
        }
        None => x.copy_from_slice(new),
    }
    let mut out = vec![0u8; lz4_flex::block::get_maximum_output_size(BLOCK_SIZE)];
    let n = lz4_flex::block::compress_into(&x, &mut out).ok()?;
    if n > limit || n == 0 {
        return None;
    }
    out.truncate(n);
    Some(JournalDelta {
        block,
        zero_base: base.is_none(),
        base_crc: base.map_or(*ZERO_BLOCK_CRC, crc32c::crc32c),
        result_crc: crc32c::crc32c(new),
        xor_lz4: out,
    })
}

/// crc32c of a block of zeros: the base checksum of a zero-based delta.
static ZERO_BLOCK_CRC: std::sync::LazyLock<u32> = std::sync::LazyLock::new(|| crc32c::crc32c(&[0u8; BLOCK_SIZE]));

/// Apply a delta to its base: the new contents, or None if the base or the result is
/// not the block the delta was made for.
pub fn apply_delta(d: &JournalDelta, base: Option<&[u8]>) -> Option<Vec<u8>> {
    let zero = [0u8; BLOCK_SIZE];
    let base = if d.zero_base { &zero[..] } else { base? };
    if base.len() != BLOCK_SIZE || crc32c::crc32c(base) != d.base_crc {
        return None;
    }
    let mut x = vec![0u8; BLOCK_SIZE];
    match lz4_flex::block::decompress_into(&d.xor_lz4, &mut x) {
        Ok(n) if n == BLOCK_SIZE => {}
        _ => return None,
    }
    for (o, b) in x.iter_mut().zip(base) {
        *o ^= b;
    }
    (crc32c::crc32c(&x) == d.result_crc).then_some(x)
}

fn check(done: Vec<crate::device::Done>) -> Result<()> {
    for d in done {
        d.result?;
    }
    Ok(())
}

impl Journal {
    /// A journal whose log is empty and whose next transaction has sequence `next_seq`.
    pub fn new(sb: &Superblock, next_seq: u64) -> Journal {
        Journal {
            header_block: sb.journal_start,
            log_start: sb.journal_start + 1,
            log_len: sb.journal_blocks - 1,
            pos: 0,
            next_seq,
            pending: BTreeMap::new(),
            deltas: false,
            stats: JournalStats::default(),
        }
    }

    /// Carry changed blocks as deltas where they are small (hitchhiking).
    pub fn with_deltas(mut self, on: bool) -> Journal {
        self.deltas = on;
        self
    }

    /// The most log blocks one transaction may take (descriptors, images and the
    /// commit block): the whole log, emptied by a checkpoint first if need be.
    pub fn capacity(&self) -> u64 {
        self.log_len
    }

    /// Make the transaction durable. On error nothing is known about the medium; the
    /// caller must poison the file system. The classic order, each step waiting for
    /// the one before (`Stack::Sync`): descriptor and images written, flush, commit
    /// block built and written, flush.
    #[cfg(test)]
    pub fn commit(&mut self, dev: &dyn Device, tx: Transaction) -> Result<()> {
        self.commit_after(dev, tx, true).map(|_| ())
    }

    /// `commit`, where `unflushed` says whether data was written since the last
    /// flush: a transaction of deltas only, after no data write, needs no flush
    /// before its commit block (nothing it depends on is in flight).
    pub fn commit_after(&mut self, dev: &dyn Device, tx: Transaction, unflushed: bool) -> Result<DeltaCounts> {
        if tx.is_empty() {
            return Ok(DeltaCounts::default());
        }
        let started = self.start(dev, tx)?;
        check(started.body.wait())?;
        if unflushed || started.n_body > 0 {
            dev.flush()?;
        }
        let mut c = dev.alloc(BLOCK_SIZE);
        started.commit.encode(&mut c);
        let (_, r) = dev.write(started.commit_at, c);
        r?;
        dev.flush()?;
        let counts = started.deltas;
        self.committed(started.n_body, started.logged, &started.revokes, counts);
        Ok(counts)
    }

    /// Put a transaction's descriptor and image blocks on the device and return
    /// without waiting for them (after a checkpoint, if the log has no room; that
    /// one waits). Nothing is committed until [`Journal::finish`] or the caller's own
    /// commit-block write; the journal's position does not move before then.
    pub fn start(&mut self, dev: &dyn Device, tx: Transaction) -> Result<StartedCommit> {
        let need = tx.log_blocks();
        if need > self.log_len {
            return Err(Error::no_space("transaction larger than the journal"));
        }
        if self.needs_checkpoint(&tx) {
            // Carried blocks this commit wrote home whole (retired) are not written
            // home again from the log: their older logged contents must not overwrite
            // the newer ones. The caller has waited for this commit's data writes, so
            // the checkpoint's flush makes those durable before the log is emptied.
            self.checkpoint_except(dev, &tx.retired)?;
        }
        let seq = self.next_seq;
        let Transaction { images: meta, mut revokes, data, retired } = tx;
        revokes.extend(retired);
        // Deltas first for data (small synchronous writes are what hitchhiking is
        // for), then for metadata, while the commit block has room. A delta must be
        // of contents the log holds (a checkpoint may just have written them home and
        // emptied it): else the block is logged whole (a zero-based delta needs no base).
        let mut deltas: Vec<JournalDelta> = Vec::new();
        let mut room = JCOMMIT_EXTRA_MAX;
        let mut counts = DeltaCounts::default();
        let mut images: Vec<(u64, AlignedBuf)> = Vec::with_capacity(meta.len() + data.len());
        let mut logged: Vec<(u64, Arc<AlignedBuf>)> = Vec::with_capacity(meta.len() + data.len());
        for d in data {
            let anchored = |x: &JournalDelta| {
                x.zero_base || self.pending.get(&d.block).is_some_and(|p| crc32c::crc32c(p) == x.base_crc)
            };
            let usable = d.delta.filter(|x| x.encoded_len() <= room && anchored(x));
            match usable {
                Some(x) => {
                    room -= x.encoded_len();
                    counts.data += 1;
                    counts.bytes += x.encoded_len() as u64;
                    deltas.push(x);
                }
                None => {
                    counts.data_images += 1;
                    images.push((d.block, AlignedBuf::from_slice(&d.content)));
                }
            }
            logged.push((d.block, d.content));
        }
        for (home, img) in meta {
            let x = if self.deltas && room > JDELTA_HEADER {
                self.pending.get(&home).and_then(|base| make_delta(home, &img, Some(base), room - JDELTA_HEADER))
            } else {
                None
            };
            let content = Arc::new(AlignedBuf::from_slice(&img));
            match x {
                Some(x) => {
                    room -= x.encoded_len();
                    counts.meta += 1;
                    counts.bytes += x.encoded_len() as u64;
                    deltas.push(x);
                }
                None => images.push((home, img)),
            }
            logged.push((home, content));
        }
        // A block logged again in this transaction is not revoked by it: the newest
        // contents replay (a freed block reused at once gets a new, anchored record).
        if !revokes.is_empty() && !logged.is_empty() {
            let l: std::collections::HashSet<u64> = logged.iter().map(|(b, _)| *b).collect();
            revokes.retain(|r| !l.contains(r));
        }
        let mut extra = Vec::with_capacity(JCOMMIT_EXTRA_MAX - room);
        for x in &deltas {
            x.encode_into(&mut extra);
        }
        // Descriptors: tags first, then revokes, JDESC_ENTRIES per block; none for a
        // transaction of deltas only.
        let escaped = |img: &[u8]| if journal_needs_escape(img) { JTAG_ESCAPED } else { 0 };
        let mut entries: Vec<(bool, u64)> = images.iter().map(|(b, img)| (true, *b | escaped(img))).collect();
        entries.extend(revokes.iter().map(|b| (false, *b)));
        let mut body: Vec<AlignedBuf> = Vec::new();
        let chunks: Vec<&[(bool, u64)]> = if entries.is_empty() && deltas.is_empty() {
            vec![&[][..]]
        } else {
            entries.chunks(JDESC_ENTRIES).collect()
        };
        for chunk in chunks {
            let desc = JournalDesc {
                seq,
                tags: chunk.iter().filter(|e| e.0).map(|e| e.1).collect(),
                revokes: chunk.iter().filter(|e| !e.0).map(|e| e.1).collect(),
            };
            let mut b = dev.alloc(BLOCK_SIZE);
            desc.encode(&mut b);
            body.push(b);
        }
        let n_desc = body.len() as u32;
        let n_images = images.len() as u32;
        for (_, img) in images {
            let mut b = dev.alloc(BLOCK_SIZE);
            b.copy_from_slice(&img);
            if journal_needs_escape(&b) {
                journal_escape(&mut b);
            }
            body.push(b);
        }
        let mut crc = 0u32;
        for b in &body {
            crc = crc32c::crc32c_append(crc, b);
        }
        let commit = JournalCommit { seq, n_desc, n_images, body_crc: crc, extra };
        let at = (self.log_start + self.pos) * BLOCK;
        let n_body = body.len() as u64;
        // Descriptor and images, in batches the device can take as single requests.
        let mut ops = Vec::new();
        let mut off = at;
        let mut body = body.into_iter().peekable();
        while body.peek().is_some() {
            let bufs: Vec<AlignedBuf> = body.by_ref().take(256).collect();
            let len = bufs.len() as u64 * BLOCK;
            ops.push(Op { kind: OpKind::Write, offset: off, bufs });
            off += len;
        }
        let body = dev.start(ops);
        Ok(StartedCommit { body, commit, commit_at: at + n_body * BLOCK, n_body, logged, revokes, deltas: counts })
    }

    /// Finish a started transaction, the asynchronous stack's way (`Stack::Async`):
    /// the commit block is built while the body is in flight, then the body is waited
    /// for and `data` waits for the transaction's data writes (ordered mode), one
    /// flush makes both durable, and the commit block goes out as a FUA write (the
    /// device writes and flushes it where it has no FUA). `data` says whether any data
    /// was written since the last flush: if none was, nothing but the journal is in
    /// flight, and the commit block is written beside the body, one flush after both
    /// (or, with no body, alone with FUA). The order on the medium is
    /// the classic one: data and journal body durable before the commit block is
    /// written.
    pub fn finish(
        &mut self,
        dev: &dyn Device,
        started: StartedCommit,
        data: impl FnOnce() -> Result<bool>,
    ) -> Result<DeltaCounts> {
        let StartedCommit { body, commit, commit_at, n_body, logged, revokes, deltas } = started;
        let mut c = dev.alloc(BLOCK_SIZE);
        commit.encode(&mut c);
        let unflushed = match data() {
            Ok(u) => u,
            Err(e) => {
                drop(body.wait());
                return Err(e);
            }
        };
        if unflushed {
            // Data the transaction may point at: durable before the commit block.
            let waited = check(body.wait());
            waited?;
            dev.flush()?;
            let mut done = dev.submit(vec![Op::write_fua(commit_at, c)]);
            done.pop().expect("one op").result?;
        } else if n_body > 0 {
            // Nothing in flight but the journal itself: the commit block's checksum
            // covers descriptors and images, so it goes out beside them and one flush
            // makes all of it durable (a torn body fails the checksum at recovery, and
            // nothing returns before the flush).
            let cw = dev.start(vec![Op::write(commit_at, c)]);
            let waited = check(body.wait());
            let wrote = check(cw.wait());
            waited?;
            wrote?;
            dev.flush()?;
        } else {
            // A transaction of deltas only: its commit block alone, written through.
            drop(body.wait());
            let mut done = dev.submit(vec![Op::write_fua(commit_at, c)]);
            done.pop().expect("one op").result?;
        }
        self.committed(n_body, logged, &revokes, deltas);
        Ok(deltas)
    }

    /// The transaction is durable: move past it in the log, keep its images for the
    /// checkpoint.
    fn committed(&mut self, n_body: u64, images: Vec<(u64, Arc<AlignedBuf>)>, revokes: &[u64], d: DeltaCounts) {
        self.pos += n_body + 1;
        self.next_seq += 1;
        self.stats.commits += 1;
        self.stats.blocks_logged += n_body + 1;
        self.stats.commit_only += (n_body == 0) as u64;
        let t = &mut self.stats.deltas;
        (t.meta, t.data, t.data_images, t.bytes) =
            (t.meta + d.meta, t.data + d.data, t.data_images + d.data_images, t.bytes + d.bytes);
        // A revoked block has no committed image to write home any more; a block is
        // never revoked and logged in one transaction (logging cancels the revoke).
        for r in revokes {
            self.pending.remove(r);
        }
        for (home, img) in images {
            self.pending.insert(home, img);
        }
    }

    /// Whether `start` must checkpoint before it can log `tx`. The caller then waits
    /// for its data writes before `start` (see there).
    pub fn needs_checkpoint(&self, tx: &Transaction) -> bool {
        self.pos + tx.log_blocks() > self.log_len
    }

    /// Write every committed image home, then empty the log.
    pub fn checkpoint(&mut self, dev: &dyn Device) -> Result<()> {
        self.checkpoint_except(dev, &[])
    }

    /// `checkpoint`, leaving out the blocks in `skip` (revoked by the transaction about
    /// to be logged).
    fn checkpoint_except(&mut self, dev: &dyn Device, skip: &[u64]) -> Result<()> {
        if self.pos == 0 {
            return Ok(());
        }
        let skip: std::collections::HashSet<u64> = skip.iter().copied().collect();
        let ops: Vec<Op> = self
            .pending
            .iter()
            .filter(|(home, _)| !skip.contains(home))
            .map(|(home, img)| {
                let mut b = dev.alloc(BLOCK_SIZE);
                b.copy_from_slice(img);
                Op::write(home * BLOCK, b)
            })
            .collect();
        check(dev.submit(ops))?;
        dev.flush()?;
        write_header(dev, self.header_block, self.next_seq)?;
        self.pending.clear();
        self.pos = 0;
        self.stats.checkpoints += 1;
        Ok(())
    }
}

pub fn write_header(dev: &dyn Device, header_block: u64, start_seq: u64) -> Result<()> {
    let mut b = dev.alloc(BLOCK_SIZE);
    JournalHeader { start_seq }.encode(&mut b);
    let (_, r) = dev.write(header_block * BLOCK, b);
    r?;
    dev.flush()?;
    Ok(())
}

/// A committed transaction read back from the log.
#[derive(Debug)]
pub struct ScannedTx {
    pub seq: u64,
    pub tags: Vec<u64>,
    pub revokes: Vec<u64>,
    pub images: Vec<Vec<u8>>,
    /// Hitchhiked blocks carried in the commit block.
    pub deltas: Vec<JournalDelta>,
}

/// What a mount finds in the journal.
#[derive(Debug)]
pub struct Scan {
    pub start_seq: u64,
    pub transactions: Vec<ScannedTx>,
}

impl Scan {
    pub fn next_seq(&self) -> u64 {
        self.start_seq + self.transactions.len() as u64
    }
}

fn read_block(dev: &dyn Device, block: u64) -> Result<AlignedBuf> {
    let (b, r) = dev.read(block * BLOCK, dev.alloc(BLOCK_SIZE));
    r?;
    Ok(b)
}

/// Read the header and every complete, checksummed transaction after it. Reading
/// stops at the first block that is not the next expected piece: a torn or missing
/// transaction is not part of the file system.
pub fn scan(dev: &dyn Device, sb: &Superblock) -> Result<Scan> {
    let header = JournalHeader::decode(&read_block(dev, sb.journal_start)?)?;
    // Sequence numbers count commits from 1: no image comes near 2^63 of them, and one
    // that says so is damaged (the arithmetic on them below could not overflow).
    if header.start_seq > u64::MAX / 2 {
        return Err(Error::corrupt(format!("journal header: sequence number {} out of range", header.start_seq)));
    }
    let log_start = sb.journal_start + 1;
    let log_len = sb.journal_blocks - 1;
    let mut out = Scan { start_seq: header.start_seq, transactions: Vec::new() };
    let mut pos = 0u64;
    let mut seq = header.start_seq;
    'tx: while pos < log_len {
        let mut body_crc = 0u32;
        let mut tags = Vec::new();
        let mut revokes = Vec::new();
        let mut n_desc = 0u32;
        // Descriptors until the first non-descriptor block (none: a transaction of
        // deltas only starts with its commit block).
        loop {
            if pos + n_desc as u64 >= log_len {
                break 'tx;
            }
            let b = read_block(dev, log_start + pos + n_desc as u64)?;
            match JournalDesc::decode(&b) {
                Ok(d) if d.seq == seq => {
                    body_crc = crc32c::crc32c_append(body_crc, &b);
                    tags.extend(d.tags);
                    revokes.extend(d.revokes);
                    n_desc += 1;
                }
                _ => break,
            }
        }
        let images_at = pos + n_desc as u64;
        if images_at + tags.len() as u64 >= log_len {
            break;
        }
        let mut images = Vec::with_capacity(tags.len());
        for i in 0..tags.len() as u64 {
            let b = read_block(dev, log_start + images_at + i)?;
            body_crc = crc32c::crc32c_append(body_crc, &b);
            let mut img = b.to_vec();
            if tags[i as usize] & JTAG_ESCAPED != 0 {
                journal_escape(&mut img);
            }
            images.push(img);
        }
        let commit_at = images_at + tags.len() as u64;
        let c = match JournalCommit::decode(&read_block(dev, log_start + commit_at)?) {
            Ok(c) => c,
            Err(_) => break,
        };
        if c.seq != seq || c.n_desc != n_desc || c.n_images as usize != tags.len() || c.body_crc != body_crc {
            break;
        }
        if n_desc == 0 && c.extra.is_empty() {
            break;
        }
        // Sealed by the commit block's checksum: bad records are damage, not a tear.
        let deltas = JournalDelta::decode_all(&c.extra)
            .map_err(|e| Error::corrupt(format!("journal transaction {seq}: {e}")))?;
        for t in &mut tags {
            *t &= !JTAG_ESCAPED;
        }
        let valid = |b: &u64| *b > sb.journal_start + sb.journal_blocks - 1 && *b < sb.data_end;
        if !tags.iter().all(valid) || !revokes.iter().all(valid) || !deltas.iter().all(|d| valid(&d.block)) {
            return Err(Error::corrupt(format!(
                "journal transaction {seq} names blocks outside the metadata and data areas"
            )));
        }
        out.transactions.push(ScannedTx { seq, tags, revokes, images, deltas });
        pos = commit_at + 1;
        seq += 1;
    }
    Ok(out)
}

/// The final contents of every block the scanned transactions write, after revokes:
/// images and deltas applied in sequence order, each delta to the contents the log
/// before it gives its block (or to zeros). A delta whose base is not there, or not
/// the one it was made against, is damage (the writer never makes one): an error,
/// never a guess.
pub fn plan(scan: &Scan) -> Result<BTreeMap<u64, Vec<u8>>> {
    let mut revoked: HashMap<u64, u64> = HashMap::new();
    for tx in &scan.transactions {
        for r in &tx.revokes {
            revoked.insert(*r, tx.seq);
        }
    }
    let live = |b: u64, seq: u64| revoked.get(&b).is_none_or(|r| *r < seq);
    let mut out: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    for tx in &scan.transactions {
        for (home, img) in tx.tags.iter().zip(&tx.images) {
            if live(*home, tx.seq) {
                out.insert(*home, img.clone());
            }
        }
        for d in &tx.deltas {
            if !live(d.block, tx.seq) {
                continue;
            }
            let new = apply_delta(d, out.get(&d.block).map(|v| &v[..])).ok_or_else(|| {
                Error::corrupt(format!(
                    "journal transaction {}: the delta of block {} does not apply to the contents the log gives it",
                    tx.seq, d.block
                ))
            })?;
            out.insert(d.block, new);
        }
    }
    Ok(out)
}

/// Replay a scan onto the device and empty the log. Idempotent: a crash during replay
/// leaves the header untouched, and the next mount replays the same images again.
#[cfg(test)]
pub fn replay(dev: &dyn Device, sb: &Superblock, scan: &Scan) -> Result<usize> {
    replay_planned(dev, sb, scan, plan(scan)?)
}

/// Write `images` (`plan(scan)`) home, flush, and start the log after `scan`.
pub fn replay_planned(dev: &dyn Device, sb: &Superblock, scan: &Scan, images: BTreeMap<u64, Vec<u8>>) -> Result<usize> {
    let n = images.len();
    if !scan.transactions.is_empty() {
        let ops: Vec<Op> = images
            .into_iter()
            .map(|(home, img)| {
                let mut b = dev.alloc(BLOCK_SIZE);
                b.copy_from_slice(&img);
                Op::write(home * BLOCK, b)
            })
            .collect();
        check(dev.submit(ops))?;
        dev.flush()?;
        write_header(dev, sb.journal_start, scan.next_seq())?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::mem::MemDevice;
    use crate::device::sim::{crash_image, SimConfig, SimDevice};

    const TOTAL: u64 = 1024;

    fn setup() -> (MemDevice, Superblock) {
        let sb = Superblock::layout(TOTAL, 64, 32, [1; 16], 0).unwrap();
        let dev = MemDevice::new(TOTAL * BLOCK);
        write_header(&dev, sb.journal_start, 100).unwrap();
        (dev, sb)
    }

    fn image(byte: u8) -> AlignedBuf {
        AlignedBuf::from_slice(&[byte; BLOCK_SIZE])
    }

    fn tx(images: &[(u64, u8)], revokes: &[u64]) -> Transaction {
        Transaction {
            images: images.iter().map(|(b, v)| (*b, image(*v))).collect(),
            revokes: revokes.to_vec(),
            data: Vec::new(),
            retired: Vec::new(),
        }
    }

    fn home(dev: &dyn Device, b: u64) -> u8 {
        let (buf, r) = dev.read(b * BLOCK, AlignedBuf::new(BLOCK_SIZE));
        r.unwrap();
        buf[0]
    }

    /// A transaction carrying `data` blocks (whole contents), deltas made by the
    /// journal's caller as `hitchhike` makes them: zero-based when `fresh`, else
    /// against `base`.
    fn data_tx(j: &Journal, data: &[(u64, u8, bool)]) -> Transaction {
        let mut t = tx(&[], &[]);
        for (b, v, fresh) in data {
            let content = Arc::new(image(*v));
            let base = j.pending.get(b).map(|p| p.to_vec());
            let delta = if *fresh {
                make_delta(*b, &content, None, 3000)
            } else {
                make_delta(*b, &content, base.as_deref(), 3000)
            };
            t.data.push(DataBlock { block: *b, content, delta });
        }
        t
    }

    #[test]
    fn deltas_ride_in_the_commit_block_and_replay() {
        let (dev, sb) = setup();
        let b = sb.data_start + 3;
        let mut j = Journal::new(&sb, 100).with_deltas(true);
        // A fresh block (from zeros), then two changes of it as deltas of the last.
        for (v, fresh) in [(1u8, true), (2, false), (3, false)] {
            let t = data_tx(&j, &[(b, v, fresh)]);
            let counts = j.commit_after(&dev, t, false).unwrap();
            assert_eq!(counts.data, 1, "version {v} as a delta");
        }
        assert_eq!(j.stats.commit_only, 3, "no descriptor, no image: the commit block alone");
        assert_eq!(j.pos, 3);
        let s = scan(&dev, &sb).unwrap();
        assert_eq!(s.transactions.len(), 3);
        assert!(s.transactions.iter().all(|t| t.deltas.len() == 1 && t.images.is_empty()));
        // The home block never held any of them; replay builds the last from zeros.
        dev.write(b * BLOCK, image(0xee)).1.unwrap();
        replay(&dev, &sb, &s).unwrap();
        assert_eq!(home(&dev, b), 3);
    }

    #[test]
    fn metadata_images_become_deltas_of_their_logged_contents() {
        let (dev, sb) = setup();
        let m = sb.inode_table_start;
        let mut j = Journal::new(&sb, 100).with_deltas(true);
        let mut img = vec![7u8; BLOCK_SIZE];
        j.commit(
            &dev,
            Transaction {
                images: vec![(m, AlignedBuf::from_slice(&img))],
                revokes: vec![],
                data: vec![],
                retired: vec![],
            },
        )
        .unwrap();
        img[100..108].copy_from_slice(b"changed!");
        let t = Transaction {
            images: vec![(m, AlignedBuf::from_slice(&img))],
            revokes: vec![],
            data: vec![],
            retired: vec![],
        };
        let counts = j.commit_after(&dev, t, false).unwrap();
        assert_eq!((counts.meta, j.stats.commit_only), (1, 1));
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        let (got, r) = dev.read(m * BLOCK, AlignedBuf::new(BLOCK_SIZE));
        r.unwrap();
        assert_eq!(&got[..], &img[..]);
        // Off: the same change is an image.
        let (dev, sb) = setup();
        let mut j = Journal::new(&sb, 100);
        for _ in 0..2 {
            let t = Transaction {
                images: vec![(m, AlignedBuf::from_slice(&img))],
                revokes: vec![],
                data: vec![],
                retired: vec![],
            };
            assert_eq!(j.commit_after(&dev, t, false).unwrap().meta, 0);
        }
        assert_eq!(j.stats.commit_only, 0);
    }

    #[test]
    fn a_delta_whose_base_is_not_in_the_log_is_logged_whole() {
        let (dev, sb) = setup();
        let b = sb.data_start + 1;
        let mut j = Journal::new(&sb, 100).with_deltas(true);
        j.commit_after(&dev, data_tx(&j, &[(b, 1, true)]), false).unwrap();
        let t = data_tx(&j, &[(b, 2, false)]);
        // A checkpoint empties the log (and writes the block home): the delta made
        // against the logged contents has no base in the log any more.
        j.checkpoint(&dev).unwrap();
        let counts = j.commit_after(&dev, t, false).unwrap();
        assert_eq!((counts.data, counts.data_images), (0, 1));
        dev.write(b * BLOCK, image(0xee)).1.unwrap();
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        assert_eq!(home(&dev, b), 2);
    }

    #[test]
    fn revoked_deltas_do_not_replay_and_a_bad_base_is_damage() {
        let (dev, sb) = setup();
        let b = sb.data_start + 2;
        let mut j = Journal::new(&sb, 100).with_deltas(true);
        j.commit_after(&dev, data_tx(&j, &[(b, 1, true)]), false).unwrap();
        j.commit_after(&dev, tx(&[], &[b]), false).unwrap();
        dev.write(b * BLOCK, image(42)).1.unwrap();
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        assert_eq!(home(&dev, b), 42, "a revoked delta must not clobber the block's new contents");
        // A chained delta with no base in the log: an error, never a guess.
        let mut s = Scan { start_seq: 1, transactions: vec![] };
        let d = make_delta(b, &image(5), Some(&image(4)), 3000).unwrap();
        s.transactions.push(ScannedTx {
            seq: 1,
            tags: vec![],
            revokes: vec![],
            images: vec![],
            deltas: vec![d.clone()],
        });
        assert_eq!(plan(&s).unwrap_err().kind(), crate::ErrorKind::Corrupt);
        // Its base in the log, but different contents: the same.
        s.transactions.insert(
            0,
            ScannedTx { seq: 0, tags: vec![b], revokes: vec![], images: vec![image(3).to_vec()], deltas: vec![] },
        );
        assert_eq!(plan(&s).unwrap_err().kind(), crate::ErrorKind::Corrupt);
        s.transactions[0].images[0] = image(4).to_vec();
        assert_eq!(plan(&s).unwrap()[&b], image(5).to_vec());
    }

    #[test]
    fn a_checkpoint_never_writes_a_retired_block_back() {
        let (dev, sb) = setup();
        let b = sb.data_start + 6;
        let mut j = Journal::new(&sb, 100).with_deltas(true);
        j.commit_after(&dev, data_tx(&j, &[(b, 1, true)]), false).unwrap();
        // Fill the log until the next transaction needs a checkpoint.
        let mut i = 0u64;
        // (Bigger than each filler, so that the log reaches a point where it alone
        // needs the checkpoint.)
        let mut retire = tx(&[(sb.data_start + 30, 1), (sb.data_start + 31, 1), (sb.data_start + 32, 1)], &[]);
        retire.retired.push(b);
        while !j.needs_checkpoint(&retire) {
            j.commit(&dev, tx(&[(sb.data_start + 20 + i % 5, i as u8)], &[])).unwrap();
            i += 1;
        }
        // The commit writes the block's newer contents in place, then logs the revoke;
        // its checkpoint must not write the older logged contents over them.
        dev.write(b * BLOCK, image(9)).1.unwrap();
        let before = j.stats.checkpoints;
        j.commit(&dev, retire).unwrap();
        assert_eq!(j.stats.checkpoints, before + 1);
        assert_eq!(home(&dev, b), 9);
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        assert_eq!(home(&dev, b), 9);
    }

    #[test]
    fn images_that_look_like_journal_blocks_are_escaped() {
        let (dev, sb) = setup();
        let b = sb.data_start + 7;
        let mut j = Journal::new(&sb, 100);
        // A data block crafted as this journal's next commit block and descriptor.
        let mut fake = AlignedBuf::new(BLOCK_SIZE);
        JournalDesc { seq: 100, tags: vec![sb.inode_table_start], revokes: vec![] }.encode(&mut fake);
        let mut t = tx(&[], &[]);
        t.data.push(DataBlock { block: b, content: Arc::new(AlignedBuf::from_slice(&fake)), delta: None });
        j.commit(&dev, t).unwrap();
        j.commit(&dev, tx(&[(sb.data_start, 5)], &[])).unwrap();
        let s = scan(&dev, &sb).unwrap();
        assert_eq!(s.transactions.len(), 2, "the crafted block is an image, not a descriptor");
        replay(&dev, &sb, &s).unwrap();
        let (got, r) = dev.read(b * BLOCK, AlignedBuf::new(BLOCK_SIZE));
        r.unwrap();
        assert_eq!(&got[..], &fake[..], "unescaped on replay");
        assert_eq!(home(&dev, sb.data_start), 5);
    }

    #[test]
    fn torn_commit_only_transactions_end_the_log() {
        let sim = SimDevice::new(vec![0; (TOTAL * BLOCK) as usize], SimConfig::default());
        let sb = Superblock::layout(TOTAL, 64, 32, [1; 16], 0).unwrap();
        write_header(&sim, sb.journal_start, 100).unwrap();
        let base = sim.start_recording();
        let b = sb.data_start + 4;
        let mut j = Journal::new(&sb, 100).with_deltas(true);
        for (v, fresh) in [(1u8, true), (2, false), (3, false), (4, false)] {
            let t = data_tx(&j, &[(b, v, fresh)]);
            let done = j.start(&sim, t).unwrap();
            // The asynchronous stack's way: the commit block with FUA, no flush.
            j.finish(&sim, done, || Ok(false)).unwrap();
        }
        let log = sim.log();
        for k in 0..=log.len() {
            for seed in 0..8 {
                let dev = MemDevice::from_vec(crash_image(&base, &log, k, seed));
                let s = scan(&dev, &sb).unwrap();
                let n = s.transactions.len();
                assert!(n <= 4);
                replay(&dev, &sb, &s).unwrap();
                if n > 0 {
                    assert_eq!(home(&dev, b), n as u8, "point {k} seed {seed}");
                }
                if k == log.len() {
                    assert_eq!(n, 4);
                }
            }
        }
    }

    #[test]
    fn committed_transactions_replay_in_order() {
        let (dev, sb) = setup();
        let data = sb.data_start;
        let mut j = Journal::new(&sb, 100);
        j.commit(&dev, tx(&[(data, 1), (data + 1, 2)], &[])).unwrap();
        j.commit(&dev, tx(&[(data, 3)], &[])).unwrap();
        let scan = scan(&dev, &sb).unwrap();
        assert_eq!(scan.transactions.len(), 2);
        assert_eq!(scan.next_seq(), 102);
        assert_eq!(replay(&dev, &sb, &scan).unwrap(), 2);
        assert_eq!((home(&dev, data), home(&dev, data + 1)), (3, 2), "newest image wins");
        // The header moved past them: a second scan finds nothing to replay.
        assert!(super::scan(&dev, &sb).unwrap().transactions.is_empty());
    }

    #[test]
    fn revoke_prevents_replay_of_older_images() {
        let (dev, sb) = setup();
        let b = sb.data_start + 5;
        let mut j = Journal::new(&sb, 100);
        j.commit(&dev, tx(&[(b, 7)], &[])).unwrap();
        j.commit(&dev, tx(&[], &[b])).unwrap();
        // The block now holds file data, written in place (not journaled).
        dev.write(b * BLOCK, image(42)).1.unwrap();
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        assert_eq!(home(&dev, b), 42, "the revoked metadata image must not clobber the data");
        // Logged again after the revoke: that later image does replay.
        let (dev, sb) = setup();
        let mut j = Journal::new(&sb, 100);
        j.commit(&dev, tx(&[(b, 7)], &[])).unwrap();
        j.commit(&dev, tx(&[], &[b])).unwrap();
        j.commit(&dev, tx(&[(b, 9)], &[])).unwrap();
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        assert_eq!(home(&dev, b), 9);
    }

    #[test]
    fn torn_or_missing_commit_block_ends_the_log() {
        let sim = SimDevice::new(vec![0; (TOTAL * BLOCK) as usize], SimConfig::default());
        let sb = Superblock::layout(TOTAL, 64, 32, [1; 16], 0).unwrap();
        write_header(&sim, sb.journal_start, 100).unwrap();
        let base = sim.start_recording();
        let mut j = Journal::new(&sb, 100);
        j.commit(&sim, tx(&[(sb.data_start, 1)], &[])).unwrap();
        j.commit(&sim, tx(&[(sb.data_start, 2), (sb.data_start + 1, 2)], &[])).unwrap();
        let log = sim.log();
        // Every crash point: the scan finds a prefix of whole transactions, never part
        // of one, and never fails.
        for k in 0..=log.len() {
            for seed in 0..8 {
                let dev = MemDevice::from_vec(crash_image(&base, &log, k, seed));
                let s = scan(&dev, &sb).unwrap();
                assert!(s.transactions.len() <= 2);
                for (i, t) in s.transactions.iter().enumerate() {
                    assert_eq!(t.images.len(), i + 1, "point {k} seed {seed}: transaction {i} whole");
                }
                if k == log.len() {
                    assert_eq!(s.transactions.len(), 2, "both committed");
                }
            }
        }
    }

    #[test]
    fn checksum_mismatch_stops_replay() {
        let (dev, sb) = setup();
        let mut j = Journal::new(&sb, 100);
        j.commit(&dev, tx(&[(sb.data_start, 1)], &[])).unwrap();
        j.commit(&dev, tx(&[(sb.data_start, 2)], &[])).unwrap();
        // Corrupt the image block of the second transaction (log blocks: d, i, c, d, i, c).
        let at = (sb.journal_start + 1 + 4) * BLOCK;
        dev.write(at, image(0xee)).1.unwrap();
        let s = scan(&dev, &sb).unwrap();
        assert_eq!(s.transactions.len(), 1);
        replay(&dev, &sb, &s).unwrap();
        assert_eq!(home(&dev, sb.data_start), 1);
    }

    #[test]
    fn replay_is_idempotent() {
        let (dev, sb) = setup();
        let mut j = Journal::new(&sb, 100);
        for v in 1..=5u8 {
            j.commit(&dev, tx(&[(sb.data_start + v as u64 % 3, v)], &[])).unwrap();
        }
        let s = scan(&dev, &sb).unwrap();
        let planned = plan(&s).unwrap();
        // Replay writes the same images however often it is interrupted and redone.
        for _ in 0..3 {
            for (b, img) in &planned {
                dev.write(b * BLOCK, AlignedBuf::from_slice(img)).1.unwrap();
            }
        }
        let once: Vec<u8> = (0..3).map(|i| home(&dev, sb.data_start + i)).collect();
        replay(&dev, &sb, &s).unwrap();
        let twice: Vec<u8> = (0..3).map(|i| home(&dev, sb.data_start + i)).collect();
        assert_eq!(once, twice);
        assert_eq!(twice, vec![3, 4, 5]);
    }

    #[test]
    fn stale_log_of_an_earlier_generation_is_ignored() {
        let (dev, sb) = setup();
        let mut j = Journal::new(&sb, 100);
        j.commit(&dev, tx(&[(sb.data_start, 1)], &[])).unwrap();
        j.commit(&dev, tx(&[(sb.data_start + 1, 1)], &[])).unwrap();
        // Checkpoint empties the log; the old transactions stay in its blocks.
        j.checkpoint(&dev).unwrap();
        assert!(scan(&dev, &sb).unwrap().transactions.is_empty());
        // A new, shorter transaction at the start of the log; the old second one after
        // it has an older sequence number and must not be taken as the next.
        j.commit(&dev, tx(&[(sb.data_start + 2, 9)], &[])).unwrap();
        assert_eq!(scan(&dev, &sb).unwrap().transactions.len(), 1);
    }

    #[test]
    fn full_log_checkpoints_before_the_next_commit() {
        let (dev, sb) = setup();
        let mut j = Journal::new(&sb, 100);
        for i in 0..40u64 {
            j.commit(&dev, tx(&[(sb.data_start + i % 7, i as u8)], &[])).unwrap();
        }
        assert!(j.stats.checkpoints > 0);
        replay(&dev, &sb, &scan(&dev, &sb).unwrap()).unwrap();
        for i in 33..40u64 {
            assert_eq!(home(&dev, sb.data_start + i % 7), i as u8);
        }
        let too_big: Vec<(u64, u8)> = (0..40).map(|i| (sb.data_start + i, 1)).collect();
        assert_eq!(j.commit(&dev, tx(&too_big, &[])).unwrap_err().kind(), crate::ErrorKind::NoSpace);
    }
}
