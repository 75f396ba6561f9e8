//! fsck: check every invariant of an image and report; never repair.
//!
//! It reads the medium directly (through `format` and `journal`), as the image would
//! look after journal replay, without writing anything. Checks: superblock and its
//! backup; checksums of every metadata block; the block bitmap against the blocks that
//! extents, extent chains and directories own (no block owned twice, none leaked);
//! the inode bitmap against the inode table; link counts; directory structure and
//! connectivity from the root; sizes against extents; and that an image marked clean
//! has nothing left to replay or free.
//!
//! Its cost follows what is in use, not the size of the image: bitmaps are scanned a
//! word at a time, and only the inode-table blocks that hold an in-use inode are read
//! (the inode bitmap is authoritative: a table block none of whose inodes is in use
//! may hold anything, as `mkfs` does not zero the table). Blocks are read in runs,
//! several requests at a time.

use crate::device::{Device, Op};
use crate::error::Result;
use crate::format::{self as f, DiskInode, ExtentBlock, Superblock, BLOCK, BLOCK_SIZE};
use crate::journal;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

#[derive(Debug, Default)]
pub struct Report {
    /// Invariant violations. Empty means the image is consistent.
    pub errors: Vec<String>,
    /// Facts worth knowing that are not violations (a journal to replay, orphans).
    pub notes: Vec<String>,
    pub inodes_used: u64,
    pub directories: u64,
    pub files: u64,
    pub blocks_used: u64,
    /// The superblock says the image was unmounted cleanly (a mount trusts it).
    pub marked_clean: bool,
    /// Those of `errors` that a mount repairs itself (a damaged primary superblock
    /// whose backup is intact, a format upgrade the backup has and the primary not):
    /// they do not stop a mount that runs this check.
    pub repairable: Vec<String>,
    pub superblock: Option<Superblock>,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Blocks per read request, and requests in flight at once.
const RUN_BLOCKS: u64 = 32;
const RUNS_IN_FLIGHT: usize = 16;

/// A block's bytes, or why it could not be read.
type Read<'b> = std::result::Result<&'b [u8], String>;

struct Reader<'a> {
    dev: &'a dyn Device,
    overlay: BTreeMap<u64, Vec<u8>>,
}

impl Reader<'_> {
    fn read(&self, b: u64) -> std::result::Result<Vec<u8>, String> {
        if let Some(img) = self.overlay.get(&b) {
            return Ok(img.clone());
        }
        // A number read from a damaged image can be anything: past the device, it is
        // a finding, not a read.
        let at = b.checked_mul(BLOCK).filter(|at| at.checked_add(BLOCK).is_some_and(|end| end <= self.dev.len()));
        let Some(at) = at else {
            return Err(format!("block {b}: past the end of the device"));
        };
        let (buf, r) = self.dev.read(at, self.dev.alloc(BLOCK_SIZE));
        r.map_err(|e| format!("block {b}: {e}"))?;
        Ok(buf.to_vec())
    }

    /// Read `blocks` (ascending), adjacent ones in one request and several requests
    /// at a time; `each` gets every block in order, with its bytes or why not.
    fn read_many(&self, blocks: &[u64], each: &mut dyn FnMut(u64, Read<'_>)) {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &b in blocks {
            match runs.last_mut() {
                Some((s, n)) if *s + *n == b && *n < RUN_BLOCKS => *n += 1,
                _ => runs.push((b, 1)),
            }
        }
        for batch in runs.chunks(RUNS_IN_FLIGHT) {
            let ops = batch
                .iter()
                .map(|&(s, n)| Op {
                    kind: crate::device::OpKind::Read,
                    offset: s * BLOCK,
                    bufs: (0..n).map(|_| self.dev.alloc(BLOCK_SIZE)).collect(),
                })
                .collect();
            for (&(s, n), done) in batch.iter().zip(self.dev.submit(ops)) {
                for i in 0..n {
                    let b = s + i;
                    match (self.overlay.get(&b), &done.result) {
                        (Some(img), _) => each(b, Ok(img)),
                        (None, Ok(())) => each(b, Ok(&done.bufs[i as usize][..])),
                        // Which block of the run failed: read them one by one.
                        (None, Err(_)) => match self.read(b) {
                            Ok(img) => each(b, Ok(&img)),
                            Err(e) => each(b, Err(e)),
                        },
                    }
                }
            }
        }
    }
}

/// A bitmap in memory, scanned a word at a time.
struct Bits {
    words: Vec<u64>,
    len: u64,
}

impl Bits {
    fn new(len: u64) -> Bits {
        Bits { words: vec![0; len.div_ceil(64) as usize], len }
    }

    fn get(&self, i: u64) -> bool {
        i < self.len && self.words[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// The words that hold bits `from..to` (clamped to the bitmap), each with the
    /// mask of those bits in it.
    fn spans(&self, from: u64, to: u64) -> impl Iterator<Item = (usize, u64)> {
        let to = to.min(self.len);
        let (first, last) = (from / 64, to.saturating_sub(1) / 64);
        (first..=last).filter(move |_| from < to).map(move |w| {
            let lo = if w == first { from % 64 } else { 0 };
            let hi = if w == last { (to - 1) % 64 } else { 63 };
            (w as usize, (!0u64 >> (63 - hi)) & (!0u64 << lo))
        })
    }

    fn count(&self, from: u64, to: u64) -> u64 {
        self.spans(from, to).map(|(w, m)| (self.words[w] & m).count_ones() as u64).sum()
    }

    fn any(&self, from: u64, to: u64) -> bool {
        self.spans(from, to).any(|(w, m)| self.words[w] & m != 0)
    }

    fn set_range(&mut self, from: u64, to: u64) {
        for (w, m) in self.spans(from, to).collect::<Vec<_>>() {
            self.words[w] |= m;
        }
    }

    /// Every bit in `from..to` for which `pick(word index, word)` has a one, in order.
    fn ones<'a>(&'a self, from: u64, to: u64, pick: impl Fn(usize, u64) -> u64 + 'a) -> impl Iterator<Item = u64> + 'a {
        self.spans(from, to).flat_map(move |(w, m)| {
            let mut x = pick(w, self.words[w]) & m;
            std::iter::from_fn(move || {
                (x != 0).then(|| {
                    let i = x.trailing_zeros() as u64;
                    x &= x - 1;
                    w as u64 * 64 + i
                })
            })
        })
    }
}

struct Node {
    d: DiskInode,
    extents: Vec<f::Extent>,
}

const MAX_ERRORS: usize = 200;

/// The first `bits` bits of a bitmap stored in `blocks` blocks from `start`, with every
/// checksum or read failure reported.
fn read_bitmap(rd: &Reader<'_>, what: &str, start: u64, blocks: u64, bits: u64, r: &mut Report) -> Bits {
    let mut out = Bits::new(bits);
    // A bitmap block holds a whole number of 32-bit words: copy them.
    const WORDS32: u64 = f::BITS_PER_BITMAP_BLOCK / 32;
    let list: Vec<u64> = (start..start + blocks).collect();
    rd.read_many(&list, &mut |b, res| {
        let i = b - start;
        let b = match res {
            Ok(b) => b,
            Err(e) => {
                push_error(r, format!("cannot read {what} bitmap: {e}"));
                return;
            }
        };
        if let Err(e) = f::bitmap_check(b, i) {
            push_error(r, format!("{what} bitmap block {i}: {e}"));
        }
        for k in 0..WORDS32 {
            let n = (i * WORDS32 + k) * 32;
            if n >= bits {
                break;
            }
            let v = u32::from_le_bytes(b[k as usize * 4..k as usize * 4 + 4].try_into().expect("4 bytes")) as u64;
            out.words[(n / 64) as usize] |= v << (n % 64);
        }
    });
    // Bits past the end of the bitmap are not part of it.
    if !bits.is_multiple_of(64) {
        *out.words.last_mut().expect("bits > 0") &= !0u64 >> (64 - bits % 64);
    }
    out
}

fn push_error(r: &mut Report, s: String) {
    if r.errors.len() < MAX_ERRORS {
        r.errors.push(s);
    }
}

/// Who owns which data blocks, as the inodes are read.
struct Claims<'a> {
    sb: &'a Superblock,
    bbits: &'a Bits,
    claimed: Bits,
    /// Every claimed run (first block, count, inode), to name the first owner of a
    /// block claimed twice.
    runs: Vec<(u64, u64, u64)>,
}

impl Claims<'_> {
    /// Inode `ino` owns blocks `start..start+len`.
    fn claim(&mut self, r: &mut Report, ino: u64, start: u64, len: u64, what: &str) {
        let end = start.saturating_add(len);
        let (ds, de) = (self.sb.data_start, self.sb.data_end);
        if start < ds || end > de {
            let bad = if start < ds { start } else { start.max(de) };
            push_error(r, format!("inode {ino}: {what} block {bad} outside the data area"));
        }
        let (start, end) = (start.max(ds), end.min(de));
        if start >= end {
            return;
        }
        if self.claimed.any(start, end) {
            let room = MAX_ERRORS.saturating_sub(r.errors.len());
            for blk in self.claimed.ones(start, end, |_, w| w).take(room).collect::<Vec<_>>() {
                if r.errors.len() >= MAX_ERRORS {
                    break;
                }
                let o = self.runs.iter().find(|(s, n, _)| (*s..s + n).contains(&blk)).map_or(0, |x| x.2);
                push_error(r, format!("block {blk} owned twice (inodes {o} and {ino})"));
            }
        }
        if self.bbits.count(start, end) != end - start {
            for blk in self.bbits.ones(start, end, |_, w| !w).take(MAX_ERRORS) {
                push_error(r, format!("block {blk} of inode {ino} is marked free"));
            }
        }
        self.claimed.set_range(start, end);
        self.runs.push((start, end - start, ino));
    }
}

/// Check the image on `dev`. Errors only if the image cannot be identified at all.
pub fn check(dev: &dyn Device) -> Result<Report> {
    check_with_progress(dev, &mut |_, _| {})
}

/// [`check`], calling `progress(done, total)` in metadata blocks read. `total` grows
/// as the check finds what there is to read (the directories' blocks are known only
/// once the inodes are read).
pub fn check_with_progress(dev: &dyn Device, progress: &mut dyn FnMut(u64, u64)) -> Result<Report> {
    let mut r = Report::default();
    let (sb, used_backup) = crate::fs::read_superblock(dev)?;
    r.marked_clean = sb.clean;
    let err = push_error;
    let repairable = |r: &mut Report, e: String| {
        r.repairable.push(e.clone());
        push_error(r, e);
    };
    if used_backup {
        repairable(&mut r, "primary superblock is damaged (the backup is intact; a writable mount rewrites it)".into());
    } else {
        // Where mkfs put it: the image's last block, which is not the device's when
        // the device grew after mkfs.
        let (b, res) = dev.read((sb.total_blocks - 1) * BLOCK, dev.alloc(BLOCK_SIZE));
        match res.map_err(|e| e.to_string()).and_then(|_| Superblock::decode(&b).map_err(|e| e.to_string())) {
            // Only the primary's state word is kept up to date.
            Ok(backup) if Superblock { clean: sb.clean, ..backup.clone() } == sb => {}
            // The upgrade writes the backup first: a crash before the primary leaves this.
            Ok(backup)
                if Superblock { clean: sb.clean, version: sb.version, ..backup.clone() } == sb
                    && (sb.version..=crate::format::VERSION).contains(&backup.version) =>
            {
                repairable(
                    &mut r,
                    format!(
                        "format upgrade unfinished: the backup superblock says version {}, the primary {} (a \
                         writable mount finishes it)",
                        backup.version, sb.version
                    ),
                );
            }
            Ok(_) => err(&mut r, "backup superblock differs from the primary".into()),
            // The upgrade's write of the backup torn by a crash: the primary is whole
            // and the next writable mount writes the backup again.
            Err(e) if sb.version < crate::format::VERSION => repairable(
                &mut r,
                format!(
                    "backup superblock: {e} (format upgrade unfinished from version {}: a writable mount \
                     writes it again)",
                    sb.version
                ),
            ),
            Err(e) => err(&mut r, format!("backup superblock: {e}")),
        }
    }
    let scan = match journal::scan(dev, &sb) {
        Ok(s) => s,
        Err(e) => {
            err(&mut r, format!("journal: {e}"));
            r.superblock = Some(sb);
            return Ok(r);
        }
    };
    if !scan.transactions.is_empty() {
        if sb.clean {
            err(&mut r, format!("marked clean, but the journal holds {} transaction(s)", scan.transactions.len()));
        }
        r.notes.push(format!(
            "journal holds {} committed transaction(s) not yet replayed (the next mount replays them); checked the image as they leave it",
            scan.transactions.len()
        ));
    }
    // A delta that does not apply to what the log gives its block is damage to the
    // journal: reported, and the image checked as it is.
    let overlay = journal::plan(&scan).unwrap_or_else(|e| {
        err(&mut r, format!("journal cannot be replayed: {e}"));
        Default::default()
    });
    let rd = Reader { dev, overlay };
    let mut total_work = sb.block_bitmap_blocks + sb.inode_bitmap_blocks;
    let mut done = 0;
    progress(done, total_work);

    // Bitmaps.
    let bbits = read_bitmap(&rd, "block", sb.block_bitmap_start, sb.block_bitmap_blocks, sb.total_blocks, &mut r);
    let fixed = [(0, sb.data_start), (sb.data_end, sb.total_blocks)];
    for (from, to) in fixed {
        for blk in bbits.ones(from, to, |_, w| !w).take(MAX_ERRORS) {
            err(&mut r, format!("block {blk} holds fixed metadata but is marked free"));
        }
    }
    let ibits = read_bitmap(&rd, "inode", sb.inode_bitmap_start, sb.inode_bitmap_blocks, sb.inode_count, &mut r);
    done += sb.block_bitmap_blocks + sb.inode_bitmap_blocks;

    // The table blocks with an inode in use (inode n is bit n - 1).
    let per = f::INODES_PER_BLOCK;
    let mut table: Vec<u64> = Vec::new();
    for (w, word) in ibits.words.iter().enumerate() {
        for q in 0..64 / per {
            if word >> (q * per) & ((1 << per) - 1) != 0 {
                table.push((w as u64 * 64 + q * per) / per);
            }
        }
    }
    total_work += table.len() as u64;
    progress(done, total_work);

    // Inodes, their extents, and who owns each block.
    let mut claims = Claims { sb: &sb, bbits: &bbits, claimed: Bits::new(sb.total_blocks), runs: Vec::new() };
    let mut nodes: BTreeMap<u64, Node> = BTreeMap::new();
    let blocks: Vec<u64> = table.iter().map(|t| sb.inode_table_start + t).collect();
    rd.read_many(&blocks, &mut |blk, res| {
        done += 1;
        if done % 256 == 0 {
            progress(done, total_work);
        }
        let b = match res {
            Ok(b) => b,
            Err(e) => {
                err(&mut r, format!("cannot read inode table: {e}"));
                return;
            }
        };
        let t = blk - sb.inode_table_start;
        for k in 0..per {
            let ino = t * per + k + 1;
            let slot = &b[(k as usize) * f::INODE_SIZE..(k as usize + 1) * f::INODE_SIZE];
            let used = ibits.get(ino - 1);
            match DiskInode::decode(ino, slot) {
                Ok(None) if used => err(&mut r, format!("inode {ino} is marked in use but its slot is empty")),
                Ok(None) => {}
                // A table block with an inode in use has been written whole since
                // (the first inode to land in it zeroes it): its free slots are zero.
                Ok(Some(_)) if !used => err(&mut r, format!("inode {ino} has contents but is marked free")),
                Err(_) if !used => err(&mut r, format!("inode {ino} has contents but is marked free")),
                Ok(Some(d)) => {
                    nodes.insert(ino, check_inode(&rd, &mut claims, &mut r, ino, d));
                }
                Err(e) => err(&mut r, format!("inode {ino}: {e}")),
            }
        }
    });
    let data = (sb.data_start, sb.data_end);
    r.blocks_used = bbits.count(data.0, data.1);
    let claimed = claims.claimed;
    for blk in bbits.ones(data.0, data.1, |w, x| x & !claimed.words[w]).take(MAX_ERRORS) {
        err(&mut r, format!("block {blk} is marked in use but nobody owns it (leaked)"));
    }
    for (ino, n) in &nodes {
        r.inodes_used += 1;
        match n.d.mode & f::S_IFMT {
            f::S_IFDIR => r.directories += 1,
            f::S_IFREG => r.files += 1,
            _ => {}
        }
        if n.d.nlink == 0 && sb.clean {
            err(&mut r, format!("inode {ino} is an orphan, but the image is marked clean (it would never be freed)"));
        }
    }

    // Directories: entries, link counts, parents, connectivity. Blocks outside the
    // data area were reported with the extents, and are not read.
    // Only the blocks below a directory's size hold its entries, and a block two
    // directories claim (a cross-link, reported with the extents) is read for the
    // first: what is read is bounded by the data area, whatever the image says.
    let mut seen_dir_blocks: HashSet<u64> = HashSet::new();
    let dir_blocks: Vec<(u64, Vec<u64>)> = nodes
        .iter()
        .filter(|(_, n)| n.d.mode & f::S_IFMT == f::S_IFDIR)
        .map(|(ino, n)| {
            let nblocks = n.d.size / BLOCK;
            let mut blocks = Vec::new();
            for e in &n.extents {
                let len = (e.len as u64).min(nblocks.saturating_sub(e.logical as u64));
                let phys = e.physical.max(data.0)..e.physical.saturating_add(len).min(data.1);
                blocks.extend(phys.filter(|b| seen_dir_blocks.insert(*b)));
            }
            (*ino, blocks)
        })
        .collect();
    total_work += dir_blocks.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
    progress(done, total_work);
    let mut refs: HashMap<u64, u32> = HashMap::new();
    let mut subdirs: HashMap<u64, u32> = HashMap::new();
    let mut parent_of: HashMap<u64, u64> = HashMap::new();
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    for (ino, blocks) in &dir_blocks {
        let ino = *ino;
        // A removed directory is empty (rmdir and a rename over it require it):
        // names in it are damage, and not counted as links (freeing it at the next
        // mount would leave their inodes with a link too many).
        let removed = nodes.get(&ino).is_some_and(|n| n.d.nlink == 0);
        let mut names = HashSet::new();
        let mut sorted = blocks.clone();
        sorted.sort_unstable();
        sorted.dedup();
        let mut got: HashMap<u64, std::result::Result<Vec<Option<f::Dirent>>, String>> = HashMap::new();
        rd.read_many(&sorted, &mut |blk, res| {
            got.insert(blk, res.and_then(|b| f::dir_block_decode(ino, b).map_err(|e| e.to_string())));
        });
        done += sorted.len() as u64;
        progress(done, total_work);
        for &blk in blocks {
            let entries = match got.get(&blk).cloned().unwrap_or_else(|| Err("not read".into())) {
                Ok(x) => x,
                Err(e) => {
                    err(&mut r, format!("directory {ino}: block {blk}: {e}"));
                    continue;
                }
            };
            for d in entries.into_iter().flatten() {
                let name = String::from_utf8_lossy(&d.name).into_owned();
                if removed {
                    err(&mut r, format!("removed directory {ino} still holds entry {name:?}"));
                    continue;
                }
                if d.ino == f::ROOT_INO {
                    err(&mut r, format!("directory {ino}: entry {name:?} names the root directory"));
                    continue;
                }
                if !names.insert(d.name.clone()) {
                    err(&mut r, format!("directory {ino}: duplicate name {name:?}"));
                }
                let Some(child) = nodes.get(&d.ino) else {
                    err(&mut r, format!("directory {ino}: entry {name:?} points at free inode {}", d.ino));
                    continue;
                };
                if crate::fs::meta::ftype_of(child.d.mode) != d.ftype {
                    err(&mut r, format!("directory {ino}: entry {name:?} has the wrong file type"));
                }
                *refs.entry(d.ino).or_default() += 1;
                children.entry(ino).or_default().push(d.ino);
                if child.d.mode & f::S_IFMT == f::S_IFDIR {
                    *subdirs.entry(ino).or_default() += 1;
                    if let Some(p) = parent_of.insert(d.ino, ino) {
                        err(&mut r, format!("directory {} has two parents ({p} and {ino})", d.ino));
                    }
                }
            }
        }
    }
    for (ino, n) in &nodes {
        let is_dir = n.d.mode & f::S_IFMT == f::S_IFDIR;
        if n.d.nlink == 0 {
            if *ino == f::ROOT_INO {
                err(&mut r, "the root directory has link count 0 (a mount would free it as an orphan)".to_string());
            } else if refs.contains_key(ino) {
                err(&mut r, format!("inode {ino} has link count 0 but is named in a directory"));
            } else {
                r.notes.push(format!("inode {ino} is an orphan (unlinked while open); the next mount frees it"));
            }
            continue;
        }
        if is_dir {
            let want = 2 + subdirs.get(ino).copied().unwrap_or(0);
            if n.d.nlink != want {
                err(&mut r, format!("directory {ino}: link count {} but {want} expected", n.d.nlink));
            }
            let expect_parent =
                if *ino == f::ROOT_INO { f::ROOT_INO } else { parent_of.get(ino).copied().unwrap_or(0) };
            if n.d.parent != expect_parent {
                err(&mut r, format!("directory {ino}: parent {} recorded, {expect_parent} found", n.d.parent));
            }
        } else {
            let have = refs.get(ino).copied().unwrap_or(0);
            if n.d.nlink != have {
                err(&mut r, format!("inode {ino}: link count {} but {have} names", n.d.nlink));
            }
        }
    }
    match nodes.get(&f::ROOT_INO) {
        Some(n) if n.d.mode & f::S_IFMT == f::S_IFDIR => {}
        _ => err(&mut r, "root inode is missing or not a directory".into()),
    }
    let mut seen = HashSet::from([f::ROOT_INO]);
    let mut queue = VecDeque::from([f::ROOT_INO]);
    while let Some(d) = queue.pop_front() {
        for c in children.get(&d).into_iter().flatten() {
            if seen.insert(*c) {
                queue.push_back(*c);
            }
        }
    }
    for (ino, n) in &nodes {
        if n.d.nlink > 0 && !seen.contains(ino) {
            err(&mut r, format!("inode {ino} is not reachable from the root"));
        }
    }
    progress(total_work, total_work);
    r.superblock = Some(sb);
    Ok(r)
}

/// Check the extended attributes of `ino` whose first block is `head`: each block
/// belongs to it and is where it should be, and the entries parse. Claims the blocks and
/// returns how many there are.
fn check_xattrs(rd: &Reader<'_>, claims: &mut Claims<'_>, r: &mut Report, ino: u64, head: u64) -> u64 {
    let err = push_error;
    claims.claim(r, ino, head, 1, "xattr");
    let decoded = rd.read(head).map_err(|e| e.to_string()).and_then(|b| {
        let h = f::xattr_decode_head(&b, ino).map_err(|e| e.to_string())?;
        Ok(h)
    });
    // An ACL the engine cannot decode fails every create in its directory, or a
    // chmod of its file, with EINVAL.
    let check_acls = |r: &mut Report, entries: &f::Xattrs| {
        for (name, value) in entries {
            if name == crate::fs::perm::ACL_ACCESS || name == crate::fs::perm::ACL_DEFAULT {
                if let Err(e) = crate::fs::perm::Acl::decode(value) {
                    err(r, format!("inode {ino}: {}: {e}", String::from_utf8_lossy(name)));
                }
            }
        }
    };
    match decoded {
        Ok(f::XattrHead::Legacy(entries)) => {
            check_acls(r, &entries);
            1
        }
        Ok(f::XattrHead::Chained { count, conts, part }) => {
            let mut stream = part;
            for (i, c) in conts.iter().enumerate() {
                claims.claim(r, ino, *c, 1, "xattr");
                match rd
                    .read(*c)
                    .map_err(|e| e.to_string())
                    .and_then(|b| f::xattr_decode_cont(&b, ino, i + 1).map(|p| p.to_vec()).map_err(|e| e.to_string()))
                {
                    Ok(p) => stream.extend_from_slice(&p),
                    Err(e) => err(r, format!("inode {ino}: xattr block {c}: {e}")),
                }
            }
            match f::xattr_parse(&stream, count) {
                Ok(entries) => check_acls(r, &entries),
                Err(e) => err(r, format!("inode {ino}: extended attributes: {e}")),
            }
            1 + conts.len() as u64
        }
        Err(e) => {
            err(r, format!("inode {ino}: xattr block: {e}"));
            1
        }
    }
}

/// Check one in-use inode: its extent chain, attribute block, extents, sizes; claim
/// its blocks. Returns it with its extents sorted.
fn check_inode(rd: &Reader<'_>, claims: &mut Claims<'_>, r: &mut Report, ino: u64, d: DiskInode) -> Node {
    let err = push_error;
    let mut extents = d.extents.clone();
    let mut next = d.ext_block;
    let mut chain = 0u64;
    let mut seen = std::collections::HashSet::new();
    while next != 0 {
        chain += 1;
        // Bounded by what the inode records, whatever its count says: a chain that
        // comes back to a block, or holds more extents than recorded, stops here.
        if chain > d.n_extents as u64 / f::EXTENTS_PER_BLOCK as u64 + 1
            || !seen.insert(next)
            || extents.len() > d.n_extents as usize
        {
            err(r, format!("inode {ino}: extent chain too long or looping at block {next}"));
            break;
        }
        claims.claim(r, ino, next, 1, "extent");
        match rd.read(next).map_err(|e| e.to_string()).and_then(|b| ExtentBlock::decode(&b).map_err(|e| e.to_string()))
        {
            Ok(eb) if eb.ino == ino => {
                extents.extend(eb.extents);
                next = eb.next;
            }
            Ok(eb) => {
                err(r, format!("inode {ino}: extent block {next} belongs to inode {}", eb.ino));
                break;
            }
            Err(e) => {
                err(r, format!("inode {ino}: extent block {next}: {e}"));
                break;
            }
        }
    }
    if d.xattr_block != 0 {
        chain += check_xattrs(rd, claims, r, ino, d.xattr_block);
    }
    if d.flags & f::INODE_FLAG_INLINE == 0 && extents.len() != d.n_extents as usize {
        err(r, format!("inode {ino}: {} extents found, {} recorded", extents.len(), d.n_extents));
    }
    let mut data = 0u64;
    let mut prev_end = 0u64;
    let mut written_end = 0u64;
    let kind = d.mode & f::S_IFMT;
    let mut sorted = extents;
    sorted.sort_by_key(|e| e.logical);
    for e in &sorted {
        if e.len == 0 {
            err(r, format!("inode {ino}: empty extent"));
        }
        if (e.logical as u64) < prev_end {
            err(r, format!("inode {ino}: overlapping extents at file block {}", e.logical));
        }
        if e.end() > f::MAX_FILE_SIZE / BLOCK {
            err(r, format!("inode {ino}: extent at file block {} reaches past the largest file", e.logical));
        }
        if e.unwritten && kind != f::S_IFREG {
            err(r, format!("inode {ino}: unwritten extent in a file that is not regular"));
        }
        prev_end = e.end();
        if !e.unwritten {
            written_end = e.end();
        }
        claims.claim(r, ino, e.physical, e.len as u64, "data");
        data += e.len as u64;
    }
    if d.blocks != data + chain {
        err(r, format!("inode {ino}: block count {} but owns {}", d.blocks, data + chain));
    }
    // Blocks allocated past the end of the file (fallocate KEEP_SIZE) are unwritten.
    if written_end > d.size.div_ceil(BLOCK) {
        err(r, format!("inode {ino}: written extents reach past its size {}", d.size));
    }
    if kind == f::S_IFDIR && (!d.size.is_multiple_of(BLOCK) || data != d.size / BLOCK || prev_end != d.size / BLOCK) {
        err(r, format!("directory {ino}: size {} does not match its {data} blocks", d.size));
    }
    if kind == f::S_IFLNK && (d.size == 0 || d.size as usize > f::SYMLINK_MAX) {
        err(r, format!("symlink {ino}: bad target length {}", d.size));
    }
    if kind == f::S_IFLNK && d.flags & f::INODE_FLAG_INLINE == 0 && data != 1 {
        err(r, format!("symlink {ino}: target not in exactly one block"));
    }
    Node { d, extents: sorted }
}

#[cfg(test)]
mod tests {
    use super::Bits;

    #[test]
    fn bit_ranges() {
        let mut b = Bits::new(200);
        b.set_range(3, 5);
        b.set_range(60, 130);
        assert!(b.get(3) && b.get(4) && !b.get(5) && b.get(64) && b.get(129) && !b.get(130));
        assert_eq!(b.count(0, 200), 2 + 70);
        assert_eq!(b.count(61, 65), 4);
        assert!(b.any(100, 101) && !b.any(5, 60) && !b.any(7, 7));
        assert_eq!(b.ones(0, 200, |_, w| w).take(3).collect::<Vec<_>>(), vec![3, 4, 60]);
        assert_eq!(b.ones(0, 70, |_, w| !w).count(), 70 - 2 - 10);
        assert_eq!(b.ones(190, 300, |_, w| !w).collect::<Vec<_>>(), (190..200).collect::<Vec<_>>());
    }
}
