//! journal: physical redo journal for metadata, ordered mode for data.
//!
//! Interface: the file-system layer collects the images of the metadata blocks a
//! transaction changed, and the home blocks it freed (revokes); after the data those
//! blocks refer to is on the device, it calls [`Journal::commit`]. `commit` writes the
//! descriptor and image blocks, flushes, writes the checksummed commit block, flushes
//! again; only then is the transaction durable. Committed images are kept until a
//! [`Journal::checkpoint`] writes them home and advances the journal header.
//! [`scan`] and [`plan`] read a journal back after a crash; replay is idempotent
//! because it only ever writes whole committed images, newest last, skipping blocks a
//! later (or the same) transaction revoked.
//!
//! The log restarts at its first block after every checkpoint (a circular log that
//! is always emptied before it wraps); see docs/FORMAT.md for the crash cases.

use crate::device::{AlignedBuf, Device, Op, OpKind};
use crate::error::{Error, Result};
use crate::format::{JournalCommit, JournalDesc, JournalHeader, Superblock, BLOCK, BLOCK_SIZE, JDESC_ENTRIES};
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
    /// Committed images not yet written home.
    pending: BTreeMap<u64, Arc<AlignedBuf>>,
    pub stats: JournalStats,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct JournalStats {
    pub commits: u64,
    pub checkpoints: u64,
    pub blocks_logged: u64,
}

/// A transaction whose descriptor and image blocks are on their way to the log
/// ([`Journal::start`]); dropping it waits for them and commits nothing.
pub struct StartedCommit {
    body: crate::device::Pending,
    commit: JournalCommit,
    /// Byte offset of the commit block.
    commit_at: u64,
    n_body: u64,
    images: Vec<(u64, Arc<AlignedBuf>)>,
    revokes: Vec<u64>,
}

/// One transaction ready to commit.
pub struct Transaction {
    pub images: Vec<(u64, AlignedBuf)>,
    pub revokes: Vec<u64>,
    /// Extra records carried in the commit block (empty until hitchhiking lands).
    pub extra: Vec<u8>,
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.images.is_empty() && self.revokes.is_empty() && self.extra.is_empty()
    }
    fn desc_blocks(&self) -> u64 {
        ((self.images.len() + self.revokes.len()).div_ceil(JDESC_ENTRIES)).max(1) as u64
    }
    /// Log blocks this transaction needs.
    pub fn log_blocks(&self) -> u64 {
        self.desc_blocks() + self.images.len() as u64 + 1
    }
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
            stats: JournalStats::default(),
        }
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
    pub fn commit(&mut self, dev: &dyn Device, tx: Transaction) -> Result<()> {
        if tx.is_empty() {
            return Ok(());
        }
        let started = self.start(dev, tx)?;
        check(started.body.wait())?;
        dev.flush()?;
        let mut c = dev.alloc(BLOCK_SIZE);
        started.commit.encode(&mut c);
        let (_, r) = dev.write(started.commit_at, c);
        r?;
        dev.flush()?;
        self.committed(started.n_body, started.images, &started.revokes);
        Ok(())
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
        if self.pos + need > self.log_len {
            self.checkpoint(dev)?;
        }
        let seq = self.next_seq;
        // Descriptors: tags first, then revokes, JDESC_ENTRIES per block.
        let mut entries: Vec<(bool, u64)> = tx.images.iter().map(|(b, _)| (true, *b)).collect();
        entries.extend(tx.revokes.iter().map(|b| (false, *b)));
        let mut body: Vec<AlignedBuf> = Vec::new();
        let chunks: Vec<&[(bool, u64)]> =
            if entries.is_empty() { vec![&[][..]] } else { entries.chunks(JDESC_ENTRIES).collect() };
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
        let mut images = Vec::with_capacity(tx.images.len());
        for (home, img) in tx.images {
            let mut b = dev.alloc(BLOCK_SIZE);
            b.copy_from_slice(&img);
            body.push(b);
            images.push((home, Arc::new(img)));
        }
        let mut crc = 0u32;
        for b in &body {
            crc = crc32c::crc32c_append(crc, b);
        }
        let commit = JournalCommit { seq, n_desc, n_images: images.len() as u32, body_crc: crc, extra: tx.extra };
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
        Ok(StartedCommit { body, commit, commit_at: at + n_body * BLOCK, n_body, images, revokes: tx.revokes })
    }

    /// Finish a started transaction, the asynchronous stack's way (`Stack::Async`):
    /// the commit block is built while the body is in flight, then the body is waited
    /// for and `data` waits for the transaction's data writes (ordered mode), one
    /// flush makes both durable, and the commit block goes out as a FUA write (the
    /// device writes and flushes it where it has no FUA). The order on the medium is
    /// the classic one: data and journal body durable before the commit block is
    /// written.
    pub fn finish(
        &mut self,
        dev: &dyn Device,
        started: StartedCommit,
        data: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let StartedCommit { body, commit, commit_at, n_body, images, revokes } = started;
        let mut c = dev.alloc(BLOCK_SIZE);
        commit.encode(&mut c);
        let waited = check(body.wait());
        data()?;
        waited?;
        dev.flush()?;
        let mut done = dev.submit(vec![Op::write_fua(commit_at, c)]);
        done.pop().expect("one op").result?;
        self.committed(n_body, images, &revokes);
        Ok(())
    }

    /// The transaction is durable: move past it in the log, keep its images for the
    /// checkpoint.
    fn committed(&mut self, n_body: u64, images: Vec<(u64, Arc<AlignedBuf>)>, revokes: &[u64]) {
        self.pos += n_body + 1;
        self.next_seq += 1;
        self.stats.commits += 1;
        self.stats.blocks_logged += n_body + 1;
        // A revoked block has no committed image to write home any more; a block is
        // never revoked and logged in one transaction (logging cancels the revoke).
        for r in revokes {
            self.pending.remove(r);
        }
        for (home, img) in images {
            self.pending.insert(home, img);
        }
    }

    /// Write every committed image home, then empty the log.
    pub fn checkpoint(&mut self, dev: &dyn Device) -> Result<()> {
        if self.pos == 0 {
            return Ok(());
        }
        let ops: Vec<Op> = self
            .pending
            .iter()
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
        // Descriptors until the first non-descriptor block.
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
                _ if n_desc > 0 => break,
                _ => break 'tx,
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
            images.push(b.to_vec());
        }
        let commit_at = images_at + tags.len() as u64;
        let c = match JournalCommit::decode(&read_block(dev, log_start + commit_at)?) {
            Ok(c) => c,
            Err(_) => break,
        };
        if c.seq != seq || c.n_desc != n_desc || c.n_images as usize != tags.len() || c.body_crc != body_crc {
            break;
        }
        let valid = |b: &u64| *b > sb.journal_start + sb.journal_blocks - 1 && *b < sb.data_end;
        if !tags.iter().all(valid) || !revokes.iter().all(valid) {
            return Err(Error::corrupt(format!(
                "journal transaction {seq} names blocks outside the metadata and data areas"
            )));
        }
        out.transactions.push(ScannedTx { seq, tags, revokes, images });
        pos = commit_at + 1;
        seq += 1;
    }
    Ok(out)
}

/// The final image of every block the scanned transactions write, after revokes.
pub fn plan(scan: &Scan) -> BTreeMap<u64, Vec<u8>> {
    let mut revoked: HashMap<u64, u64> = HashMap::new();
    for tx in &scan.transactions {
        for r in &tx.revokes {
            revoked.insert(*r, tx.seq);
        }
    }
    let mut out = BTreeMap::new();
    for tx in &scan.transactions {
        for (home, img) in tx.tags.iter().zip(&tx.images) {
            if revoked.get(home).is_some_and(|r| *r >= tx.seq) {
                continue;
            }
            out.insert(*home, img.clone());
        }
    }
    out
}

/// Replay a scan onto the device and empty the log. Idempotent: a crash during replay
/// leaves the header untouched, and the next mount replays the same images again.
pub fn replay(dev: &dyn Device, sb: &Superblock, scan: &Scan) -> Result<usize> {
    let images = plan(scan);
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
            extra: Vec::new(),
        }
    }

    fn home(dev: &dyn Device, b: u64) -> u8 {
        let (buf, r) = dev.read(b * BLOCK, AlignedBuf::new(BLOCK_SIZE));
        r.unwrap();
        buf[0]
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
        let planned = plan(&s);
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
