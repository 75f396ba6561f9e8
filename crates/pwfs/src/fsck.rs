//! fsck: check every invariant of an image and report; never repair.
//!
//! It reads the medium directly (through `format` and `journal`), as the image would
//! look after journal replay, without writing anything. Checks: superblock and its
//! backup; checksums of every metadata block; the block bitmap against the blocks that
//! extents, extent chains and directories own (no block owned twice, none leaked);
//! the inode bitmap against the inode table; link counts; directory structure and
//! connectivity from the root; sizes against extents.

use crate::device::Device;
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
    pub superblock: Option<Superblock>,
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.errors.is_empty()
    }
}

struct Reader<'a> {
    dev: &'a dyn Device,
    overlay: BTreeMap<u64, Vec<u8>>,
}

impl Reader<'_> {
    fn read(&self, b: u64) -> std::result::Result<Vec<u8>, String> {
        if let Some(img) = self.overlay.get(&b) {
            return Ok(img.clone());
        }
        let (buf, r) = self.dev.read(b * BLOCK, self.dev.alloc(BLOCK_SIZE));
        r.map_err(|e| format!("block {b}: {e}"))?;
        Ok(buf.to_vec())
    }
}

struct Node {
    d: DiskInode,
    extents: Vec<f::Extent>,
}

const MAX_ERRORS: usize = 200;

/// The first `bits` bits of a bitmap stored in `blocks` blocks from `start`, with every
/// checksum or read failure reported.
fn read_bitmap(rd: &Reader<'_>, what: &str, start: u64, blocks: u64, bits: u64, r: &mut Report) -> Vec<bool> {
    let mut out = vec![false; bits as usize];
    for i in 0..blocks {
        let b = match rd.read(start + i) {
            Ok(b) => b,
            Err(e) => {
                push_error(r, format!("cannot read {what} bitmap: {e}"));
                continue;
            }
        };
        if let Err(e) = f::bitmap_check(&b, i) {
            push_error(r, format!("{what} bitmap block {i}: {e}"));
        }
        for bit in 0..f::BITS_PER_BITMAP_BLOCK {
            let n = i * f::BITS_PER_BITMAP_BLOCK + bit;
            if n < bits {
                out[n as usize] = b[(bit / 8) as usize] & (1 << (bit % 8)) != 0;
            }
        }
    }
    out
}

fn push_error(r: &mut Report, s: String) {
    if r.errors.len() < MAX_ERRORS {
        r.errors.push(s);
    }
}

/// Check the image on `dev`. Errors only if the image cannot be identified at all.
pub fn check(dev: &dyn Device) -> Result<Report> {
    let mut r = Report::default();
    let (sb, used_backup) = crate::fs::read_superblock(dev)?;
    let err = push_error;
    if used_backup {
        err(&mut r, "primary superblock is damaged (the backup is intact)".into());
    } else {
        let total = dev.len() / BLOCK;
        let (b, res) = dev.read((total - 1) * BLOCK, dev.alloc(BLOCK_SIZE));
        match res.map_err(|e| e.to_string()).and_then(|_| Superblock::decode(&b).map_err(|e| e.to_string())) {
            Ok(backup) if backup == sb => {}
            Ok(_) => err(&mut r, "backup superblock differs from the primary".into()),
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
        r.notes.push(format!(
            "journal holds {} committed transaction(s) not yet replayed (the next mount replays them); checked the image as they leave it",
            scan.transactions.len()
        ));
    }
    let rd = Reader { dev, overlay: journal::plan(&scan) };

    // Bitmaps.
    let bbits = read_bitmap(&rd, "block", sb.block_bitmap_start, sb.block_bitmap_blocks, sb.total_blocks, &mut r);
    for blk in (0..sb.data_start).chain(sb.data_end..sb.total_blocks) {
        if !bbits[blk as usize] {
            err(&mut r, format!("block {blk} holds fixed metadata but is marked free"));
        }
    }
    let ibits = read_bitmap(&rd, "inode", sb.inode_bitmap_start, sb.inode_bitmap_blocks, sb.inode_count, &mut r);

    // Inodes, their extents, and who owns each block.
    let mut owner: HashMap<u64, u64> = HashMap::new();
    let mut nodes: BTreeMap<u64, Node> = BTreeMap::new();
    for t in 0..sb.inode_table_blocks {
        let b = match rd.read(sb.inode_table_start + t) {
            Ok(b) => b,
            Err(e) => {
                err(&mut r, format!("cannot read inode table: {e}"));
                continue;
            }
        };
        for k in 0..f::INODES_PER_BLOCK {
            let ino = t * f::INODES_PER_BLOCK + k + 1;
            let slot = &b[(k as usize) * f::INODE_SIZE..(k as usize + 1) * f::INODE_SIZE];
            let used = ibits[(ino - 1) as usize];
            match DiskInode::decode(ino, slot) {
                Ok(None) if used => err(&mut r, format!("inode {ino} is marked in use but its slot is empty")),
                Ok(None) => {}
                Ok(Some(_)) if !used => err(&mut r, format!("inode {ino} has contents but is marked free")),
                Ok(Some(d)) => {
                    let mut claim = |r: &mut Report, blk: u64, what: &str| {
                        if blk < sb.data_start || blk >= sb.data_end {
                            err(r, format!("inode {ino}: {what} block {blk} outside the data area"));
                        } else if let Some(o) = owner.insert(blk, ino) {
                            err(r, format!("block {blk} owned twice (inodes {o} and {ino})"));
                        } else if !bbits[blk as usize] {
                            err(r, format!("block {blk} of inode {ino} is marked free"));
                        }
                    };
                    let mut extents = d.extents.clone();
                    let mut next = d.ext_block;
                    let mut chain = 0u64;
                    while next != 0 {
                        chain += 1;
                        if chain > d.n_extents as u64 / f::EXTENTS_PER_BLOCK as u64 + 1 {
                            err(&mut r, format!("inode {ino}: extent chain too long (loop?)"));
                            break;
                        }
                        claim(&mut r, next, "extent");
                        match rd
                            .read(next)
                            .map_err(|e| e.to_string())
                            .and_then(|b| ExtentBlock::decode(&b).map_err(|e| e.to_string()))
                        {
                            Ok(eb) if eb.ino == ino => {
                                extents.extend(eb.extents);
                                next = eb.next;
                            }
                            Ok(eb) => {
                                err(&mut r, format!("inode {ino}: extent block {next} belongs to inode {}", eb.ino));
                                break;
                            }
                            Err(e) => {
                                err(&mut r, format!("inode {ino}: extent block {next}: {e}"));
                                break;
                            }
                        }
                    }
                    if d.xattr_block != 0 {
                        chain += 1;
                        claim(&mut r, d.xattr_block, "xattr");
                        match rd
                            .read(d.xattr_block)
                            .map_err(|e| e.to_string())
                            .and_then(|b| f::XattrBlock::decode(&b).map_err(|e| e.to_string()))
                        {
                            Ok(x) if x.ino == ino => {}
                            Ok(x) => err(&mut r, format!("inode {ino}: xattr block belongs to inode {}", x.ino)),
                            Err(e) => err(&mut r, format!("inode {ino}: xattr block: {e}")),
                        }
                    }
                    if d.flags & f::INODE_FLAG_INLINE == 0 && extents.len() != d.n_extents as usize {
                        err(&mut r, format!("inode {ino}: {} extents found, {} recorded", extents.len(), d.n_extents));
                    }
                    let mut data = 0u64;
                    let mut prev_end = 0u64;
                    let mut sorted = extents.clone();
                    sorted.sort_by_key(|e| e.logical);
                    for e in &sorted {
                        if e.len == 0 {
                            err(&mut r, format!("inode {ino}: empty extent"));
                        }
                        if (e.logical as u64) < prev_end {
                            err(&mut r, format!("inode {ino}: overlapping extents at file block {}", e.logical));
                        }
                        prev_end = e.end();
                        for i in 0..e.len as u64 {
                            claim(&mut r, e.physical + i, "data");
                        }
                        data += e.len as u64;
                    }
                    if d.blocks != data + chain {
                        err(&mut r, format!("inode {ino}: block count {} but owns {}", d.blocks, data + chain));
                    }
                    if prev_end > d.size.div_ceil(BLOCK) {
                        err(&mut r, format!("inode {ino}: extents reach past its size {}", d.size));
                    }
                    let kind = d.mode & f::S_IFMT;
                    if kind == f::S_IFDIR && (d.size % BLOCK != 0 || data != d.size / BLOCK) {
                        err(&mut r, format!("directory {ino}: size {} does not match its {data} blocks", d.size));
                    }
                    if kind == f::S_IFLNK && (d.size == 0 || d.size as usize > f::SYMLINK_MAX) {
                        err(&mut r, format!("symlink {ino}: bad target length {}", d.size));
                    }
                    if kind == f::S_IFLNK && d.flags & f::INODE_FLAG_INLINE == 0 && data != 1 {
                        err(&mut r, format!("symlink {ino}: target not in exactly one block"));
                    }
                    r.inodes_used += 1;
                    match kind {
                        f::S_IFDIR => r.directories += 1,
                        f::S_IFREG => r.files += 1,
                        _ => {}
                    }
                    nodes.insert(ino, Node { d, extents: sorted });
                }
                Err(e) => err(&mut r, format!("inode {ino}: {e}")),
            }
        }
    }
    for blk in sb.data_start..sb.data_end {
        if bbits[blk as usize] {
            r.blocks_used += 1;
            if !owner.contains_key(&blk) {
                err(&mut r, format!("block {blk} is marked in use but nobody owns it (leaked)"));
            }
        }
    }

    // Directories: entries, link counts, parents, connectivity.
    let mut refs: HashMap<u64, u32> = HashMap::new();
    let mut subdirs: HashMap<u64, u32> = HashMap::new();
    let mut parent_of: HashMap<u64, u64> = HashMap::new();
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    for (ino, n) in &nodes {
        if n.d.mode & f::S_IFMT != f::S_IFDIR {
            continue;
        }
        let mut names = HashSet::new();
        for e in &n.extents {
            for i in 0..e.len as u64 {
                let blk = e.physical + i;
                let entries = match rd
                    .read(blk)
                    .map_err(|e| e.to_string())
                    .and_then(|b| f::dir_block_decode(*ino, &b).map_err(|e| e.to_string()))
                {
                    Ok(x) => x,
                    Err(e) => {
                        err(&mut r, format!("directory {ino}: block {blk}: {e}"));
                        continue;
                    }
                };
                for d in entries.into_iter().flatten() {
                    let name = String::from_utf8_lossy(&d.name).into_owned();
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
                    children.entry(*ino).or_default().push(d.ino);
                    if child.d.mode & f::S_IFMT == f::S_IFDIR {
                        *subdirs.entry(*ino).or_default() += 1;
                        if let Some(p) = parent_of.insert(d.ino, *ino) {
                            err(&mut r, format!("directory {} has two parents ({p} and {ino})", d.ino));
                        }
                    }
                }
            }
        }
    }
    for (ino, n) in &nodes {
        let is_dir = n.d.mode & f::S_IFMT == f::S_IFDIR;
        if n.d.nlink == 0 {
            if refs.contains_key(ino) {
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
    r.superblock = Some(sb);
    Ok(r)
}
