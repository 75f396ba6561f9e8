//! format: every on-disk structure and constant of Patchwork, in one place.
//!
//! Interface: `encode` writes a structure into a block-sized byte slice, with its
//! checksum; `decode` checks length, magic, version and checksum and returns
//! [`FormatError`] on any bad bytes — it never panics. Reader and writer share these
//! constants, so there is one definition of the layout. `docs/FORMAT.md` describes it.
//!
//! Image layout, in 4 KiB blocks:
//! `[superblock][journal header][journal log...][inode bitmap][block bitmap][inode table][data ... ][backup superblock]`

use std::fmt;

pub const BLOCK_SIZE: usize = 4096;
pub const BLOCK: u64 = BLOCK_SIZE as u64;
pub const SB_MAGIC: u64 = 0x5057_4653_5041_5443; // "PWFSPATC"
/// The format this build writes. Version 2 added hitchhiked deltas in journal commit
/// blocks (mechanism 3); a version-1 image is read as it is and becomes version 2 at
/// its first writable mount (`Superblock::upgrade`), after which older builds refuse it.
pub const VERSION: u32 = 2;
/// The oldest format this build reads.
pub const MIN_VERSION: u32 = 1;
pub const INODE_SIZE: usize = 256;
pub const INODES_PER_BLOCK: u64 = (BLOCK_SIZE / INODE_SIZE) as u64;
pub const ROOT_INO: u64 = 1;
pub const NAME_MAX: usize = 255;
/// Longest symlink target (PATH_MAX without the NUL).
pub const SYMLINK_MAX: usize = 4095;
/// Symlink targets up to this length live in the inode itself.
pub const INLINE_MAX: usize = 128;
pub const INLINE_EXTENTS: usize = 8;
/// Largest file size: 2^32 blocks of 4 KiB.
pub const MAX_FILE_SIZE: u64 = (1u64 << 32) * BLOCK;

/// Bitmap blocks keep a checksum in their last 4 bytes; the rest are bits.
pub const BITS_PER_BITMAP_BLOCK: u64 = ((BLOCK_SIZE - 4) * 8) as u64;

pub const JHEADER_MAGIC: u32 = 0x4a48_4452; // "JHDR"
pub const JDESC_MAGIC: u32 = 0x4a44_5343; // "JDSC"
pub const JCOMMIT_MAGIC: u32 = 0x4a43_4d54; // "JCMT"
pub const JDESC_HEADER: usize = 32;
/// Set in a descriptor's tag (the home block number) when the image's first four bytes
/// are stored inverted in the log: an image (file data, since hitchhiking logs some)
/// that starts like a journal header, descriptor or commit block must not be taken for
/// one by a scan of the log (jbd2's escaping).
pub const JTAG_ESCAPED: u64 = 1 << 63;

/// Whether a block logged as an image must be escaped (`JTAG_ESCAPED`).
pub fn journal_needs_escape(b: &[u8]) -> bool {
    b.len() >= 4 && [JHEADER_MAGIC, JDESC_MAGIC, JCOMMIT_MAGIC].contains(&u32_at(b, 0))
}

/// Invert the first four bytes of a logged image (escaping and unescaping alike).
pub fn journal_escape(b: &mut [u8]) {
    for x in &mut b[..4] {
        *x = !*x;
    }
}
pub const JDESC_ENTRIES: usize = (BLOCK_SIZE - JDESC_HEADER) / 8;
/// Bytes of extra records a commit block can carry (the seam for hitchhiked deltas).
pub const JCOMMIT_EXTRA_MAX: usize = BLOCK_SIZE - 64;

pub const EXT_MAGIC: u32 = 0x4558_5442; // "EXTB"
pub const EXT_HEADER: usize = 32;
pub const EXTENTS_PER_BLOCK: usize = (BLOCK_SIZE - EXT_HEADER) / 16;

pub const DIR_MAGIC: u32 = 0x4449_5242; // "DIRB"
pub const XATTR_MAGIC: u32 = 0x5841_5442; // "XATB"
pub const XATTR_HEADER: usize = 24;
/// Longest attribute name (with its namespace prefix), as on Linux.
pub const XATTR_NAME_MAX: usize = 255;
pub const DIR_HEADER: usize = 16;
pub const DIRENT_SIZE: usize = 272;
pub const DIRENTS_PER_BLOCK: usize = (BLOCK_SIZE - DIR_HEADER) / DIRENT_SIZE;

// Mode bits (as in POSIX).
pub const S_IFMT: u32 = 0o170000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFIFO: u32 = 0o010000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFSOCK: u32 = 0o140000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    Magic { what: &'static str },
    Version(u32),
    Checksum { what: &'static str },
    Invalid { what: &'static str },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::Magic { what } => write!(f, "{what}: bad magic number"),
            FormatError::Version(v) => write!(f, "unsupported format version {v} (this build reads {VERSION})"),
            FormatError::Checksum { what } => write!(f, "{what}: checksum mismatch"),
            FormatError::Invalid { what } => write!(f, "{what}: invalid field"),
        }
    }
}

impl std::error::Error for FormatError {}

type R<T> = Result<T, FormatError>;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn need_block(b: &[u8], what: &'static str) -> R<()> {
    if b.len() != BLOCK_SIZE {
        return Err(FormatError::Invalid { what });
    }
    Ok(())
}

/// crc32c of `b` with the 4 checksum bytes at `at` taken as zero, seeded with `seed`.
fn crc_skip(b: &[u8], at: usize, seed: u32) -> u32 {
    let c = crc32c::crc32c_append(seed, &b[..at]);
    let c = crc32c::crc32c_append(c, &[0; 4]);
    crc32c::crc32c_append(c, &b[at + 4..])
}

// ---------------------------------------------------------------- superblock

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub uuid: [u8; 16],
    pub total_blocks: u64,
    pub journal_start: u64,
    /// Journal blocks including its header block.
    pub journal_blocks: u64,
    pub inode_bitmap_start: u64,
    pub inode_bitmap_blocks: u64,
    pub block_bitmap_start: u64,
    pub block_bitmap_blocks: u64,
    pub inode_table_start: u64,
    pub inode_table_blocks: u64,
    pub inode_count: u64,
    pub data_start: u64,
    /// One past the last data block (the backup superblock follows).
    pub data_end: u64,
    pub created_ns: u64,
    /// Unmounted cleanly: the journal is empty, no inode is an orphan, and the last
    /// mount turned read-only after no error. A mount that trusts it skips the full
    /// check and the orphan scan. Kept in the state word, outside the checksum.
    pub clean: bool,
}

const SB_CRC_AT: usize = BLOCK_SIZE - 4;
/// The superblock's state word: [`SB_CLEAN`] when the image was unmounted cleanly,
/// anything else (zero in images made before the word existed) when it was not. It is
/// left out of the checksum, so that rewriting it changes nothing else in the block:
/// a torn write leaves either state, never a bad superblock.
pub const SB_STATE_AT: usize = 32 + 13 * 8;
/// The state word of a cleanly unmounted image ("PWCLEAN!").
pub const SB_CLEAN: u64 = u64::from_le_bytes(*b"PWCLEAN!");

/// crc32c of a superblock, with its state word and checksum taken as zero.
fn sb_crc(b: &[u8]) -> u32 {
    let c = crc32c::crc32c_append(0, &b[..SB_STATE_AT]);
    let c = crc32c::crc32c_append(c, &[0; 8]);
    let c = crc32c::crc32c_append(c, &b[SB_STATE_AT + 8..SB_CRC_AT]);
    crc32c::crc32c_append(c, &[0; 4])
}

/// The largest journal a superblock may declare: a mount scans the whole log into
/// memory (every image of every transaction, to replay them), so a hostile or damaged
/// superblock must not make it read hundreds of GiB. 4 GiB, or on a device so large
/// that its largest single operation needs more (every block-bitmap block), that.
pub fn max_journal_blocks(total_blocks: u64) -> u64 {
    (1u64 << 20).max(total_blocks.div_ceil(BITS_PER_BITMAP_BLOCK) + 32)
}

impl Superblock {
    /// Lay out an image of `total_blocks` blocks with `inode_count` inodes.
    pub fn layout(
        total_blocks: u64,
        inode_count: u64,
        journal_blocks: u64,
        uuid: [u8; 16],
        created_ns: u64,
    ) -> R<Superblock> {
        let inode_count = inode_count.next_multiple_of(INODES_PER_BLOCK);
        let inode_bitmap_blocks = inode_count.div_ceil(BITS_PER_BITMAP_BLOCK);
        let block_bitmap_blocks = total_blocks.div_ceil(BITS_PER_BITMAP_BLOCK);
        let inode_table_blocks = inode_count / INODES_PER_BLOCK;
        let journal_start = 1;
        let inode_bitmap_start = journal_start + journal_blocks;
        let block_bitmap_start = inode_bitmap_start + inode_bitmap_blocks;
        let inode_table_start = block_bitmap_start + block_bitmap_blocks;
        let data_start = inode_table_start + inode_table_blocks;
        let sb = Superblock {
            version: VERSION,
            uuid,
            total_blocks,
            journal_start,
            journal_blocks,
            inode_bitmap_start,
            inode_bitmap_blocks,
            block_bitmap_start,
            block_bitmap_blocks,
            inode_table_start,
            inode_table_blocks,
            inode_count,
            data_start,
            data_end: total_blocks.saturating_sub(1),
            created_ns,
            clean: false,
        };
        sb.check()?;
        Ok(sb)
    }

    /// Geometry invariants; a decoded superblock that breaks one is refused.
    pub fn check(&self) -> R<()> {
        let bad = |what| Err(FormatError::Invalid { what });
        if self.journal_start != 1 || self.journal_blocks < 16 {
            return bad("superblock journal geometry");
        }
        if self.journal_blocks > max_journal_blocks(self.total_blocks) {
            // A mount reads the whole log into memory. mkfs made journals up to a
            // quarter of the image before this bound (only when asked for one past
            // 4 GiB): such an image is refused with this reason, not a vague one.
            return bad("journal larger than this version reads (4 GiB, or the block bitmap + 32 blocks)");
        }
        if self.inode_count == 0
            || !self.inode_count.is_multiple_of(INODES_PER_BLOCK)
            || self.inode_table_blocks != self.inode_count / INODES_PER_BLOCK
            || self.inode_bitmap_blocks != self.inode_count.div_ceil(BITS_PER_BITMAP_BLOCK)
            || self.block_bitmap_blocks != self.total_blocks.div_ceil(BITS_PER_BITMAP_BLOCK)
        {
            return bad("superblock table sizes");
        }
        let chain = [
            (self.journal_start, self.journal_blocks, self.inode_bitmap_start),
            (self.inode_bitmap_start, self.inode_bitmap_blocks, self.block_bitmap_start),
            (self.block_bitmap_start, self.block_bitmap_blocks, self.inode_table_start),
            (self.inode_table_start, self.inode_table_blocks, self.data_start),
        ];
        for (start, len, next) in chain {
            if start.checked_add(len) != Some(next) {
                return bad("superblock region order");
            }
        }
        if self.data_end != self.total_blocks.saturating_sub(1)
            || self.data_start.checked_add(8).is_none_or(|end| end > self.data_end)
        {
            return bad("superblock data area");
        }
        Ok(())
    }

    pub fn data_blocks(&self) -> u64 {
        self.data_end - self.data_start
    }

    pub fn encode(&self, b: &mut [u8]) {
        b.fill(0);
        put64(b, 0, SB_MAGIC);
        put32(b, 8, self.version);
        put32(b, 12, BLOCK_SIZE as u32);
        b[16..32].copy_from_slice(&self.uuid);
        let fields = [
            self.total_blocks,
            self.journal_start,
            self.journal_blocks,
            self.inode_bitmap_start,
            self.inode_bitmap_blocks,
            self.block_bitmap_start,
            self.block_bitmap_blocks,
            self.inode_table_start,
            self.inode_table_blocks,
            self.inode_count,
            self.data_start,
            self.data_end,
            self.created_ns,
        ];
        for (i, v) in fields.iter().enumerate() {
            put64(b, 32 + i * 8, *v);
        }
        put64(b, SB_STATE_AT, if self.clean { SB_CLEAN } else { 0 });
        put32(b, SB_CRC_AT, sb_crc(b));
    }

    pub fn decode(b: &[u8]) -> R<Superblock> {
        need_block(b, "superblock")?;
        if u64_at(b, 0) != SB_MAGIC {
            return Err(FormatError::Magic { what: "superblock" });
        }
        if u32_at(b, SB_CRC_AT) != sb_crc(b) {
            return Err(FormatError::Checksum { what: "superblock" });
        }
        let version = u32_at(b, 8);
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(FormatError::Version(version));
        }
        if u32_at(b, 12) != BLOCK_SIZE as u32 {
            return Err(FormatError::Invalid { what: "superblock block size" });
        }
        let f = |i: usize| u64_at(b, 32 + i * 8);
        let sb = Superblock {
            version,
            uuid: b[16..32].try_into().expect("16 bytes"),
            total_blocks: f(0),
            journal_start: f(1),
            journal_blocks: f(2),
            inode_bitmap_start: f(3),
            inode_bitmap_blocks: f(4),
            block_bitmap_start: f(5),
            block_bitmap_blocks: f(6),
            inode_table_start: f(7),
            inode_table_blocks: f(8),
            inode_count: f(9),
            data_start: f(10),
            data_end: f(11),
            created_ns: f(12),
            // Any other value (a damaged word) only means "not known clean".
            clean: u64_at(b, SB_STATE_AT) == SB_CLEAN,
        };
        sb.check()?;
        Ok(sb)
    }
}

// ---------------------------------------------------------------- bitmaps

/// Stamp the checksum of a bitmap block (`index` is its position in its bitmap).
pub fn bitmap_seal(b: &mut [u8], index: u64) {
    put32(b, BLOCK_SIZE - 4, crc_skip(b, BLOCK_SIZE - 4, index as u32 ^ 0xb17b));
}

pub fn bitmap_check(b: &[u8], index: u64) -> R<()> {
    need_block(b, "bitmap block")?;
    if u32_at(b, BLOCK_SIZE - 4) != crc_skip(b, BLOCK_SIZE - 4, index as u32 ^ 0xb17b) {
        return Err(FormatError::Checksum { what: "bitmap block" });
    }
    Ok(())
}

// ---------------------------------------------------------------- inodes

/// The longest extent: its length field's top bit is the unwritten flag.
pub const EXTENT_LEN_MAX: u32 = (1 << 31) - 1;
const EXTENT_UNWRITTEN: u32 = 1 << 31;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Extent {
    /// First file block covered.
    pub logical: u32,
    /// At most EXTENT_LEN_MAX.
    pub len: u32,
    /// First device block.
    pub physical: u64,
    /// Allocated (fallocate) but never written: reads as zeros.
    pub unwritten: bool,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.logical as u64 + self.len as u64
    }
    fn encode(&self, b: &mut [u8]) {
        assert!(self.len <= EXTENT_LEN_MAX);
        put32(b, 0, self.logical);
        put32(b, 4, self.len | if self.unwritten { EXTENT_UNWRITTEN } else { 0 });
        put64(b, 8, self.physical);
    }
    fn decode(b: &[u8]) -> Extent {
        let len = u32_at(b, 4);
        Extent {
            logical: u32_at(b, 0),
            len: len & EXTENT_LEN_MAX,
            physical: u64_at(b, 8),
            unwritten: len & EXTENT_UNWRITTEN != 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

pub const INODE_FLAG_INLINE: u32 = 1;
/// chattr's flags, with Linux's FS_*_FL values: no change at all, changes only by
/// appending, no access-time updates.
pub const INODE_FLAG_IMMUTABLE: u32 = 0x10;
pub const INODE_FLAG_APPEND: u32 = 0x20;
pub const INODE_FLAG_NOATIME: u32 = 0x80;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DiskInode {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    /// Blocks owned: data plus extent blocks.
    pub blocks: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub generation: u32,
    pub flags: u32,
    /// Total number of extents (inline plus chain).
    pub n_extents: u32,
    /// Parent directory (directories only).
    pub parent: u64,
    /// Device number (character and block special files).
    pub rdev: u32,
    /// First extent-chain block, or 0.
    pub ext_block: u64,
    /// Block holding the extended attributes, or 0.
    pub xattr_block: u64,
    /// Inline extents (up to INLINE_EXTENTS), unless INODE_FLAG_INLINE.
    pub extents: Vec<Extent>,
    /// Inline data (symlink target), if INODE_FLAG_INLINE.
    pub inline: Vec<u8>,
}

const INODE_CRC_AT: usize = INODE_SIZE - 4;
const INODE_AREA: usize = 96;

impl DiskInode {
    pub fn is_free(b: &[u8]) -> bool {
        b.iter().all(|x| *x == 0)
    }

    pub fn encode(&self, ino: u64, b: &mut [u8]) {
        assert_eq!(b.len(), INODE_SIZE);
        b.fill(0);
        put32(b, 0, self.mode);
        put32(b, 4, self.uid);
        put32(b, 8, self.gid);
        put32(b, 12, self.nlink);
        put64(b, 16, self.size);
        put64(b, 24, self.blocks);
        put64(b, 32, self.atime.sec as u64);
        put32(b, 40, self.atime.nsec);
        put32(b, 44, self.mtime.nsec);
        put64(b, 48, self.mtime.sec as u64);
        put64(b, 56, self.ctime.sec as u64);
        put32(b, 64, self.ctime.nsec);
        put32(b, 68, self.generation);
        put32(b, 72, self.flags);
        put32(b, 76, self.n_extents);
        put64(b, 80, self.parent);
        put64(b, 88, self.ext_block);
        if self.flags & INODE_FLAG_INLINE != 0 {
            assert!(self.inline.len() <= INLINE_MAX);
            b[INODE_AREA..INODE_AREA + self.inline.len()].copy_from_slice(&self.inline);
        } else {
            assert!(self.extents.len() <= INLINE_EXTENTS);
            for (i, e) in self.extents.iter().enumerate() {
                e.encode(&mut b[INODE_AREA + i * 16..INODE_AREA + i * 16 + 16]);
            }
        }
        put32(b, 224, self.rdev);
        put64(b, 232, self.xattr_block);
        put32(b, INODE_CRC_AT, crc_skip(b, INODE_CRC_AT, ino as u32));
    }

    /// Decode an in-use inode slot. A free slot (all zero) is `Ok(None)`.
    pub fn decode(ino: u64, b: &[u8]) -> R<Option<DiskInode>> {
        if b.len() != INODE_SIZE {
            return Err(FormatError::Invalid { what: "inode size" });
        }
        if DiskInode::is_free(b) {
            return Ok(None);
        }
        if u32_at(b, INODE_CRC_AT) != crc_skip(b, INODE_CRC_AT, ino as u32) {
            return Err(FormatError::Checksum { what: "inode" });
        }
        let mut d = DiskInode {
            mode: u32_at(b, 0),
            uid: u32_at(b, 4),
            gid: u32_at(b, 8),
            nlink: u32_at(b, 12),
            size: u64_at(b, 16),
            blocks: u64_at(b, 24),
            atime: Timespec { sec: u64_at(b, 32) as i64, nsec: u32_at(b, 40) },
            mtime: Timespec { sec: u64_at(b, 48) as i64, nsec: u32_at(b, 44) },
            ctime: Timespec { sec: u64_at(b, 56) as i64, nsec: u32_at(b, 64) },
            generation: u32_at(b, 68),
            flags: u32_at(b, 72),
            n_extents: u32_at(b, 76),
            parent: u64_at(b, 80),
            ext_block: u64_at(b, 88),
            rdev: u32_at(b, 224),
            xattr_block: u64_at(b, 232),
            extents: Vec::new(),
            inline: Vec::new(),
        };
        let valid_type =
            matches!(d.mode & S_IFMT, S_IFREG | S_IFDIR | S_IFLNK | S_IFIFO | S_IFCHR | S_IFBLK | S_IFSOCK);
        if !valid_type || d.size > MAX_FILE_SIZE || [d.atime, d.mtime, d.ctime].iter().any(|t| t.nsec >= 1_000_000_000)
        {
            return Err(FormatError::Invalid { what: "inode fields" });
        }
        if d.flags & INODE_FLAG_INLINE != 0 {
            // Only a symlink's target is stored inline; a file or directory flagged so
            // would have its first extents dropped when it is stored again.
            if d.size as usize > INLINE_MAX || d.n_extents != 0 || d.ext_block != 0 || d.mode & S_IFMT != S_IFLNK {
                return Err(FormatError::Invalid { what: "inode inline data" });
            }
            d.inline = b[INODE_AREA..INODE_AREA + d.size as usize].to_vec();
        } else {
            let n = (d.n_extents as usize).min(INLINE_EXTENTS);
            if (d.n_extents as usize > INLINE_EXTENTS) != (d.ext_block != 0) {
                return Err(FormatError::Invalid { what: "inode extent chain" });
            }
            d.extents = (0..n).map(|i| Extent::decode(&b[INODE_AREA + i * 16..])).collect();
        }
        Ok(Some(d))
    }
}

// ---------------------------------------------------------------- extent blocks

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentBlock {
    pub ino: u64,
    pub next: u64,
    pub extents: Vec<Extent>,
}

impl ExtentBlock {
    pub fn encode(&self, b: &mut [u8]) {
        assert!(self.extents.len() <= EXTENTS_PER_BLOCK);
        b.fill(0);
        put32(b, 0, EXT_MAGIC);
        put32(b, 4, self.extents.len() as u32);
        put64(b, 8, self.ino);
        put64(b, 16, self.next);
        for (i, e) in self.extents.iter().enumerate() {
            e.encode(&mut b[EXT_HEADER + i * 16..]);
        }
        put32(b, 24, crc_skip(b, 24, 0));
    }

    pub fn decode(b: &[u8]) -> R<ExtentBlock> {
        need_block(b, "extent block")?;
        if u32_at(b, 0) != EXT_MAGIC {
            return Err(FormatError::Magic { what: "extent block" });
        }
        if u32_at(b, 24) != crc_skip(b, 24, 0) {
            return Err(FormatError::Checksum { what: "extent block" });
        }
        let n = u32_at(b, 4) as usize;
        if n > EXTENTS_PER_BLOCK {
            return Err(FormatError::Invalid { what: "extent block count" });
        }
        Ok(ExtentBlock {
            ino: u64_at(b, 8),
            next: u64_at(b, 16),
            extents: (0..n).map(|i| Extent::decode(&b[EXT_HEADER + i * 16..])).collect(),
        })
    }
}

// ---------------------------------------------------------------- directory blocks

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirent {
    pub ino: u64,
    pub ftype: u8,
    pub name: Vec<u8>,
}

/// Directory block: a header and DIRENTS_PER_BLOCK fixed slots; a slot with ino 0 is free.
pub fn dir_block_encode(owner: u64, slots: &[Option<Dirent>], b: &mut [u8]) {
    assert!(slots.len() <= DIRENTS_PER_BLOCK);
    dir_block_init(owner, b);
    for (i, s) in slots.iter().enumerate() {
        dirent_put(b, i, s.as_ref());
    }
    dir_block_seal(b);
}

/// An empty directory block of `owner`, sealed.
pub fn dir_block_init(owner: u64, b: &mut [u8]) {
    b.fill(0);
    put32(b, 0, DIR_MAGIC);
    put64(b, 8, owner);
    dir_block_seal(b);
}

/// Write (or clear) slot `i`; call `dir_block_seal` after the last change.
pub fn dirent_put(b: &mut [u8], i: usize, d: Option<&Dirent>) {
    let at = DIR_HEADER + i * DIRENT_SIZE;
    b[at..at + DIRENT_SIZE].fill(0);
    if let Some(d) = d {
        assert!(d.ino != 0 && !d.name.is_empty() && d.name.len() <= NAME_MAX);
        put64(b, at, d.ino);
        put16(b, at + 8, d.name.len() as u16);
        b[at + 10] = d.ftype;
        b[at + 12..at + 12 + d.name.len()].copy_from_slice(&d.name);
    }
}

pub fn dir_block_seal(b: &mut [u8]) {
    put32(b, 4, crc_skip(b, 4, 0));
}

pub fn dir_block_decode(owner: u64, b: &[u8]) -> R<Vec<Option<Dirent>>> {
    need_block(b, "directory block")?;
    if u32_at(b, 0) != DIR_MAGIC {
        return Err(FormatError::Magic { what: "directory block" });
    }
    if u32_at(b, 4) != crc_skip(b, 4, 0) {
        return Err(FormatError::Checksum { what: "directory block" });
    }
    if u64_at(b, 8) != owner {
        return Err(FormatError::Invalid { what: "directory block owner" });
    }
    let mut out = Vec::with_capacity(DIRENTS_PER_BLOCK);
    for i in 0..DIRENTS_PER_BLOCK {
        let at = DIR_HEADER + i * DIRENT_SIZE;
        let ino = u64_at(b, at);
        if ino == 0 {
            out.push(None);
            continue;
        }
        let n = u16_at(b, at + 8) as usize;
        let name = &b[at + 12..at + 12 + n.min(DIRENT_SIZE - 12)];
        if n == 0 || n > NAME_MAX || name.contains(&b'/') || name.contains(&0) || name == b"." || name == b".." {
            return Err(FormatError::Invalid { what: "directory entry name" });
        }
        out.push(Some(Dirent { ino, ftype: b[at + 10], name: name.to_vec() }));
    }
    Ok(out)
}

// ---------------------------------------------------------------- extended attributes

/// The extended attributes of one inode, in one block: `(name, value)` pairs, sorted
/// by name. Each entry is `name_len u8, value_len u16, name, value`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XattrBlock {
    pub ino: u64,
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl XattrBlock {
    /// Bytes the entries take in a block.
    pub fn used(entries: &[(Vec<u8>, Vec<u8>)]) -> usize {
        XATTR_HEADER + entries.iter().map(|(n, v)| 3 + n.len() + v.len()).sum::<usize>()
    }

    pub fn encode(&self, b: &mut [u8]) {
        assert!(XattrBlock::used(&self.entries) <= BLOCK_SIZE);
        b.fill(0);
        put32(b, 0, XATTR_MAGIC);
        put64(b, 8, self.ino);
        put32(b, 16, self.entries.len() as u32);
        let mut at = XATTR_HEADER;
        for (n, v) in &self.entries {
            b[at] = n.len() as u8;
            put16(b, at + 1, v.len() as u16);
            b[at + 3..at + 3 + n.len()].copy_from_slice(n);
            b[at + 3 + n.len()..at + 3 + n.len() + v.len()].copy_from_slice(v);
            at += 3 + n.len() + v.len();
        }
        put32(b, 4, crc_skip(b, 4, 0));
    }

    pub fn decode(b: &[u8]) -> R<XattrBlock> {
        need_block(b, "xattr block")?;
        if u32_at(b, 0) != XATTR_MAGIC {
            return Err(FormatError::Magic { what: "xattr block" });
        }
        if u32_at(b, 4) != crc_skip(b, 4, 0) {
            return Err(FormatError::Checksum { what: "xattr block" });
        }
        let n = u32_at(b, 16) as usize;
        let mut entries = Vec::new();
        let mut at = XATTR_HEADER;
        for _ in 0..n {
            if at + 3 > BLOCK_SIZE {
                return Err(FormatError::Invalid { what: "xattr block entries" });
            }
            let (nl, vl) = (b[at] as usize, u16_at(b, at + 1) as usize);
            if nl == 0 || at + 3 + nl + vl > BLOCK_SIZE {
                return Err(FormatError::Invalid { what: "xattr entry" });
            }
            entries.push((b[at + 3..at + 3 + nl].to_vec(), b[at + 3 + nl..at + 3 + nl + vl].to_vec()));
            at += 3 + nl + vl;
        }
        if entries.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(FormatError::Invalid { what: "xattr names out of order" });
        }
        Ok(XattrBlock { ino: u64_at(b, 8), entries })
    }
}

/// Extended attributes, current form: a head block (magic `XAT2`, crc, owner inode,
/// entry count, number of continuation blocks, their block numbers, then the start of
/// the entries) and continuation blocks (magic `XATC`, crc, owner inode, index, then
/// more of the entries). Entries: name length u8, value length u32, name, value; sorted
/// by name. Images of the first form (one `XATB` block) are read as they are and
/// rewritten in this form at their next change.
pub const XATTR2_MAGIC: u32 = 0x5841_5432; // "XAT2"
pub const XATTR_CONT_MAGIC: u32 = 0x5841_5443; // "XATC"
/// Blocks one inode's attributes may take: 256 KiB, so that several values of the
/// largest size fit.
pub const XATTR_BLOCKS_MAX: usize = 64;
/// The largest value (Linux's XATTR_SIZE_MAX).
pub const XATTR_VALUE_MAX: usize = 65536;

pub type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// What an inode's first attribute block says.
#[derive(Debug, PartialEq, Eq)]
pub enum XattrHead {
    /// The first form: all of them, in this block.
    Legacy(Xattrs),
    /// The current form: the entry count, the continuation blocks, and the head's part
    /// of the entries.
    Chained { count: u32, conts: Vec<u64>, part: Vec<u8> },
}

fn xattr_stream(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.iter().map(|(n, v)| 5 + n.len() + v.len()).sum());
    for (n, v) in entries {
        out.push(n.len() as u8);
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        out.extend_from_slice(n);
        out.extend_from_slice(v);
    }
    out
}

/// Blocks `entries` take (head included), or None past XATTR_BLOCKS_MAX.
pub fn xattr_blocks_for(entries: &[(Vec<u8>, Vec<u8>)]) -> Option<usize> {
    let len = entries.iter().map(|(n, v)| 5 + n.len() + v.len()).sum::<usize>();
    let room = |conts: usize| (BLOCK_SIZE - XATTR_HEADER - 8 * conts) + conts * (BLOCK_SIZE - XATTR_HEADER);
    (0..XATTR_BLOCKS_MAX).find(|k| room(*k) >= len).map(|k| k + 1)
}

/// The blocks of `entries` of inode `ino`, to be written at `blocks` (head first; as
/// many as `xattr_blocks_for` says).
pub fn xattr_encode(ino: u64, entries: &[(Vec<u8>, Vec<u8>)], blocks: &[u64]) -> Vec<Vec<u8>> {
    assert_eq!(Some(blocks.len()), xattr_blocks_for(entries));
    let stream = xattr_stream(entries);
    let conts = &blocks[1..];
    let mut out = Vec::with_capacity(blocks.len());
    let mut head = vec![0u8; BLOCK_SIZE];
    put32(&mut head, 0, XATTR2_MAGIC);
    put64(&mut head, 8, ino);
    put32(&mut head, 16, entries.len() as u32);
    put32(&mut head, 20, conts.len() as u32);
    let mut at = XATTR_HEADER;
    for c in conts {
        put64(&mut head, at, *c);
        at += 8;
    }
    let first = (BLOCK_SIZE - at).min(stream.len());
    head[at..at + first].copy_from_slice(&stream[..first]);
    let crc = crc_skip(&head, 4, 0);
    put32(&mut head, 4, crc);
    out.push(head);
    for (i, chunk) in stream[first..].chunks(BLOCK_SIZE - XATTR_HEADER).enumerate() {
        let mut b = vec![0u8; BLOCK_SIZE];
        put32(&mut b, 0, XATTR_CONT_MAGIC);
        put64(&mut b, 8, ino);
        put32(&mut b, 16, i as u32 + 1);
        b[XATTR_HEADER..XATTR_HEADER + chunk.len()].copy_from_slice(chunk);
        let crc = crc_skip(&b, 4, 0);
        put32(&mut b, 4, crc);
        out.push(b);
    }
    // A stream that ends exactly at a block's end leaves no empty continuation out.
    while out.len() < blocks.len() {
        let mut b = vec![0u8; BLOCK_SIZE];
        put32(&mut b, 0, XATTR_CONT_MAGIC);
        put64(&mut b, 8, ino);
        put32(&mut b, 16, out.len() as u32);
        let crc = crc_skip(&b, 4, 0);
        put32(&mut b, 4, crc);
        out.push(b);
    }
    out
}

/// Decode an inode's first attribute block (either form), checking it belongs to `ino`.
pub fn xattr_decode_head(b: &[u8], ino: u64) -> R<XattrHead> {
    need_block(b, "xattr block")?;
    if u32_at(b, 0) == XATTR_MAGIC {
        let x = XattrBlock::decode(b)?;
        if x.ino != ino {
            return Err(FormatError::Invalid { what: "xattr block of another inode" });
        }
        return Ok(XattrHead::Legacy(x.entries));
    }
    if u32_at(b, 0) != XATTR2_MAGIC {
        return Err(FormatError::Magic { what: "xattr block" });
    }
    if u32_at(b, 4) != crc_skip(b, 4, 0) {
        return Err(FormatError::Checksum { what: "xattr block" });
    }
    if u64_at(b, 8) != ino {
        return Err(FormatError::Invalid { what: "xattr block of another inode" });
    }
    let n = u32_at(b, 20) as usize;
    if n >= XATTR_BLOCKS_MAX {
        return Err(FormatError::Invalid { what: "xattr continuation count" });
    }
    let conts = (0..n).map(|i| u64_at(b, XATTR_HEADER + 8 * i)).collect();
    let part = b[XATTR_HEADER + 8 * n..].to_vec();
    Ok(XattrHead::Chained { count: u32_at(b, 16), conts, part })
}

/// The entries part of continuation block number `index` (from 1) of inode `ino`.
pub fn xattr_decode_cont(b: &[u8], ino: u64, index: usize) -> R<&[u8]> {
    need_block(b, "xattr continuation block")?;
    if u32_at(b, 0) != XATTR_CONT_MAGIC {
        return Err(FormatError::Magic { what: "xattr continuation block" });
    }
    if u32_at(b, 4) != crc_skip(b, 4, 0) {
        return Err(FormatError::Checksum { what: "xattr continuation block" });
    }
    if u64_at(b, 8) != ino || u32_at(b, 16) as usize != index {
        return Err(FormatError::Invalid { what: "xattr continuation block out of place" });
    }
    Ok(&b[XATTR_HEADER..])
}

/// Parse `count` entries from the concatenated parts (trailing zeros are padding).
pub fn xattr_parse(stream: &[u8], count: u32) -> R<Xattrs> {
    let mut entries: Xattrs = Vec::new();
    let mut at = 0;
    for _ in 0..count {
        if at + 5 > stream.len() {
            return Err(FormatError::Invalid { what: "xattr entries" });
        }
        let nl = stream[at] as usize;
        let vl = u32::from_le_bytes(stream[at + 1..at + 5].try_into().expect("4 bytes")) as usize;
        if nl == 0 || vl > XATTR_VALUE_MAX || at + 5 + nl + vl > stream.len() {
            return Err(FormatError::Invalid { what: "xattr entry" });
        }
        let (name, value) = (&stream[at + 5..at + 5 + nl], &stream[at + 5 + nl..at + 5 + nl + vl]);
        if entries.last().is_some_and(|(last, _)| last.as_slice() >= name) {
            return Err(FormatError::Invalid { what: "xattr names out of order" });
        }
        entries.push((name.to_vec(), value.to_vec()));
        at += 5 + nl + vl;
    }
    Ok(entries)
}

// ---------------------------------------------------------------- journal

/// Journal header: the sequence number of the first transaction to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalHeader {
    pub start_seq: u64,
}

impl JournalHeader {
    pub fn encode(&self, b: &mut [u8]) {
        b.fill(0);
        put32(b, 0, JHEADER_MAGIC);
        put64(b, 8, self.start_seq);
        put32(b, 4, crc_skip(b, 4, 0));
    }
    pub fn decode(b: &[u8]) -> R<JournalHeader> {
        need_block(b, "journal header")?;
        if u32_at(b, 0) != JHEADER_MAGIC {
            return Err(FormatError::Magic { what: "journal header" });
        }
        if u32_at(b, 4) != crc_skip(b, 4, 0) {
            return Err(FormatError::Checksum { what: "journal header" });
        }
        Ok(JournalHeader { start_seq: u64_at(b, 8) })
    }
}

/// A descriptor block: the home block numbers of the images that follow, and revokes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalDesc {
    pub seq: u64,
    pub tags: Vec<u64>,
    pub revokes: Vec<u64>,
}

impl JournalDesc {
    pub fn encode(&self, b: &mut [u8]) {
        assert!(self.tags.len() + self.revokes.len() <= JDESC_ENTRIES);
        b.fill(0);
        put32(b, 0, JDESC_MAGIC);
        put64(b, 8, self.seq);
        put32(b, 16, self.tags.len() as u32);
        put32(b, 20, self.revokes.len() as u32);
        for (i, t) in self.tags.iter().chain(&self.revokes).enumerate() {
            put64(b, JDESC_HEADER + i * 8, *t);
        }
        put32(b, 4, crc_skip(b, 4, self.seq as u32));
    }
    pub fn decode(b: &[u8]) -> R<JournalDesc> {
        need_block(b, "journal descriptor")?;
        if u32_at(b, 0) != JDESC_MAGIC {
            return Err(FormatError::Magic { what: "journal descriptor" });
        }
        let seq = u64_at(b, 8);
        if u32_at(b, 4) != crc_skip(b, 4, seq as u32) {
            return Err(FormatError::Checksum { what: "journal descriptor" });
        }
        let (nt, nr) = (u32_at(b, 16) as usize, u32_at(b, 20) as usize);
        if nt + nr > JDESC_ENTRIES {
            return Err(FormatError::Invalid { what: "journal descriptor counts" });
        }
        let e = |i: usize| u64_at(b, JDESC_HEADER + i * 8);
        Ok(JournalDesc { seq, tags: (0..nt).map(e).collect(), revokes: (nt..nt + nr).map(e).collect() })
    }
}

/// A hitchhiked block (mechanism 3): the XOR of a block's new contents with its last
/// durable version, LZ4-compressed, carried in a commit block instead of a whole image.
/// The base is the block as the log before it leaves it (the newest image or delta of
/// it in the log), or all zeros (`zero_base`: a block newly allocated, whose medium
/// contents mean nothing). Both checksums are crc32c of the whole 4 KiB block, so a
/// replay detects a base that is not the one the delta was made against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalDelta {
    pub block: u64,
    pub zero_base: bool,
    pub base_crc: u32,
    pub result_crc: u32,
    pub xor_lz4: Vec<u8>,
}

/// Bytes a delta record takes in a commit block besides its compressed XOR.
pub const JDELTA_HEADER: usize = 19;
const JDELTA_ZERO_BASE: u8 = 1;

impl JournalDelta {
    pub fn encoded_len(&self) -> usize {
        JDELTA_HEADER + self.xor_lz4.len()
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.block.to_le_bytes());
        out.push(if self.zero_base { JDELTA_ZERO_BASE } else { 0 });
        out.extend_from_slice(&self.base_crc.to_le_bytes());
        out.extend_from_slice(&self.result_crc.to_le_bytes());
        out.extend_from_slice(&(self.xor_lz4.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.xor_lz4);
    }

    /// The records of a commit block's extra area (the area's own checksum is the
    /// commit block's).
    pub fn decode_all(mut b: &[u8]) -> R<Vec<JournalDelta>> {
        let bad = || FormatError::Invalid { what: "journal delta record" };
        let mut out = Vec::new();
        while !b.is_empty() {
            if b.len() < JDELTA_HEADER {
                return Err(bad());
            }
            let flags = b[8];
            if flags & !JDELTA_ZERO_BASE != 0 {
                return Err(bad());
            }
            let n = u16::from_le_bytes([b[17], b[18]]) as usize;
            if n == 0 || b.len() < JDELTA_HEADER + n {
                return Err(bad());
            }
            out.push(JournalDelta {
                block: u64_at(b, 0),
                zero_base: flags & JDELTA_ZERO_BASE != 0,
                base_crc: u32_at(b, 9),
                result_crc: u32_at(b, 13),
                xor_lz4: b[JDELTA_HEADER..JDELTA_HEADER + n].to_vec(),
            });
            b = &b[JDELTA_HEADER + n..];
        }
        Ok(out)
    }
}

/// The commit block: seals a transaction with a checksum over its descriptor and image
/// blocks, and carries extra records: the transaction's hitchhiked deltas
/// ([`JournalDelta`]). A transaction of deltas only has no descriptor (`n_desc` 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalCommit {
    pub seq: u64,
    pub n_desc: u32,
    pub n_images: u32,
    pub body_crc: u32,
    pub extra: Vec<u8>,
}

impl JournalCommit {
    pub fn encode(&self, b: &mut [u8]) {
        assert!(self.extra.len() <= JCOMMIT_EXTRA_MAX);
        b.fill(0);
        put32(b, 0, JCOMMIT_MAGIC);
        put64(b, 8, self.seq);
        put32(b, 16, self.n_desc);
        put32(b, 20, self.n_images);
        put32(b, 24, self.body_crc);
        put32(b, 28, self.extra.len() as u32);
        b[64..64 + self.extra.len()].copy_from_slice(&self.extra);
        put32(b, 4, crc_skip(b, 4, self.seq as u32));
    }
    pub fn decode(b: &[u8]) -> R<JournalCommit> {
        need_block(b, "journal commit")?;
        if u32_at(b, 0) != JCOMMIT_MAGIC {
            return Err(FormatError::Magic { what: "journal commit" });
        }
        let seq = u64_at(b, 8);
        if u32_at(b, 4) != crc_skip(b, 4, seq as u32) {
            return Err(FormatError::Checksum { what: "journal commit" });
        }
        let n = u32_at(b, 28) as usize;
        if n > JCOMMIT_EXTRA_MAX {
            return Err(FormatError::Invalid { what: "journal commit extra length" });
        }
        Ok(JournalCommit {
            seq,
            n_desc: u32_at(b, 16),
            n_images: u32_at(b, 20),
            body_crc: u32_at(b, 24),
            extra: b[64..64 + n].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {

    /// A superblock may not declare a journal larger than a mount can scan into
    /// memory: 4 GiB, or more on a device whose largest operation needs more.
    #[test]
    fn the_journal_size_is_bounded() {
        use super::*;
        let total = 1u64 << 24;
        assert!(Superblock::layout(total, 4096, 1 << 20, [0; 16], 0).is_ok());
        assert!(Superblock::layout(total, 4096, (1 << 20) + 1, [0; 16], 0).is_err());
        // 2^38 blocks (1 PiB): its bitmap is more than 2^23 blocks, and the journal may
        // be that (and 32 more).
        let bitmap = (1u64 << 38).div_ceil(BITS_PER_BITMAP_BLOCK);
        assert!(bitmap > 1 << 23);
        assert_eq!(max_journal_blocks(1 << 38), bitmap + 32);
    }

    #[test]
    fn xattr_sets_round_trip_across_blocks() {
        // A stream that fills the head exactly (9-byte names: 5 + 9 + 4058 = 4072), one
        // that needs one byte of a continuation, three values of the largest size, and
        // many small ones.
        for sizes in [vec![1usize], vec![4058], vec![4059], vec![65536, 65536, 10], vec![100; 300]] {
            let entries: Xattrs = sizes
                .iter()
                .enumerate()
                .map(|(i, n)| (format!("user.{i:04}").into_bytes(), vec![i as u8; *n]))
                .collect();
            let k = xattr_blocks_for(&entries).unwrap();
            let blocks: Vec<u64> = (100..100 + k as u64).collect();
            let images = xattr_encode(7, &entries, &blocks);
            assert_eq!(images.len(), k);
            let XattrHead::Chained { count, conts, part } = xattr_decode_head(&images[0], 7).unwrap() else {
                panic!("not the current form")
            };
            assert_eq!(conts, blocks[1..]);
            let mut stream = part;
            for (i, b) in images.iter().enumerate().skip(1) {
                stream.extend_from_slice(xattr_decode_cont(b, 7, i).unwrap());
            }
            assert_eq!(xattr_parse(&stream, count).unwrap(), entries, "{sizes:?}");
            assert!(xattr_decode_head(&images[0], 8).is_err(), "another inode's");
        }
        assert_eq!(xattr_blocks_for(&[(b"user.0000".to_vec(), vec![0; 4058])]), Some(1));
        assert_eq!(xattr_blocks_for(&[(b"user.0000".to_vec(), vec![0; 4059])]), Some(2));
        let too_many: Xattrs = (0..5).map(|i| (vec![b'a' + i], vec![0; 65536])).collect();
        assert_eq!(xattr_blocks_for(&too_many), None);
        // The first form still reads.
        let mut b = vec![0; BLOCK_SIZE];
        XattrBlock { ino: 7, entries: vec![(b"user.a".to_vec(), b"1".to_vec())] }.encode(&mut b);
        assert_eq!(xattr_decode_head(&b, 7).unwrap(), XattrHead::Legacy(vec![(b"user.a".to_vec(), b"1".to_vec())]));
    }
    use super::*;
    use proptest::prelude::*;

    fn sb() -> Superblock {
        Superblock::layout(4096, 1024, 256, [7; 16], 123).unwrap()
    }

    #[test]
    fn superblock_round_trip_and_checks() {
        let s = sb();
        let mut b = vec![0; BLOCK_SIZE];
        s.encode(&mut b);
        assert_eq!(Superblock::decode(&b).unwrap(), s);
        b[100] ^= 1;
        assert_eq!(Superblock::decode(&b), Err(FormatError::Checksum { what: "superblock" }));
        let mut b = vec![0; BLOCK_SIZE];
        s.encode(&mut b);
        b[0] ^= 1;
        assert!(matches!(Superblock::decode(&b), Err(FormatError::Magic { .. })));
        let mut bad = s.clone();
        bad.version = VERSION + 1;
        bad.encode(&mut b);
        assert_eq!(Superblock::decode(&b), Err(FormatError::Version(VERSION + 1)));
        bad.version = MIN_VERSION;
        bad.encode(&mut b);
        assert_eq!(Superblock::decode(&b).unwrap().version, MIN_VERSION, "older images are read");
        let mut bad = s.clone();
        bad.data_start += 1;
        bad.encode(&mut b);
        assert!(matches!(Superblock::decode(&b), Err(FormatError::Invalid { .. })));
        assert!(Superblock::decode(&b[..100]).is_err());
    }

    #[test]
    fn clean_flag_is_one_word_outside_the_checksum() {
        let s = sb();
        assert!(!s.clean, "a laid-out image is not clean until mkfs says so");
        let (mut dirty, mut clean) = (vec![0; BLOCK_SIZE], vec![0; BLOCK_SIZE]);
        s.encode(&mut dirty);
        Superblock { clean: true, ..s.clone() }.encode(&mut clean);
        assert!(Superblock::decode(&clean).unwrap().clean);
        assert!(!Superblock::decode(&dirty).unwrap().clean);
        // Only the state word differs: a write torn anywhere leaves one state or the other.
        let differ: Vec<usize> = (0..BLOCK_SIZE).filter(|i| dirty[*i] != clean[*i]).collect();
        assert!(differ.iter().all(|i| (SB_STATE_AT..SB_STATE_AT + 8).contains(i)), "{differ:?}");
        // Images from before the flag (zeros there, checksummed whole) read as valid
        // and not clean.
        dirty[SB_STATE_AT..SB_STATE_AT + 8].fill(0);
        assert_eq!(u32_at(&dirty, SB_CRC_AT), crc_skip(&dirty, SB_CRC_AT, 0));
        assert_eq!(Superblock::decode(&dirty).unwrap(), s);
    }

    #[test]
    fn inode_round_trip() {
        let mut d = DiskInode {
            mode: S_IFREG | 0o644,
            uid: 1,
            gid: 2,
            nlink: 1,
            size: 1 << 20,
            blocks: 256,
            atime: Timespec { sec: -5, nsec: 999_999_999 },
            mtime: Timespec { sec: 1 << 40, nsec: 1 },
            ctime: Timespec { sec: 3, nsec: 4 },
            generation: 9,
            flags: 0,
            n_extents: 2,
            parent: 0,
            rdev: 0,
            ext_block: 0,
            xattr_block: 77,
            extents: vec![
                Extent { logical: 0, len: 128, physical: 1000, unwritten: false },
                Extent { logical: 128, len: 128, physical: 5000, unwritten: true },
            ],
            inline: vec![],
        };
        let mut b = vec![0; INODE_SIZE];
        d.encode(42, &mut b);
        assert_eq!(DiskInode::decode(42, &b).unwrap(), Some(d.clone()));
        assert!(DiskInode::decode(43, &b).is_err(), "checksum is seeded by inode number");
        d.mode = S_IFLNK | 0o777;
        d.flags = INODE_FLAG_INLINE;
        d.extents.clear();
        d.n_extents = 0;
        d.inline = b"../target".to_vec();
        d.size = 9;
        d.encode(42, &mut b);
        assert_eq!(DiskInode::decode(42, &b).unwrap(), Some(d));
        assert_eq!(DiskInode::decode(1, &[0; INODE_SIZE]).unwrap(), None);
    }

    #[test]
    fn blocks_round_trip() {
        let mut b = vec![0; BLOCK_SIZE];
        let e = ExtentBlock {
            ino: 5,
            next: 77,
            extents: vec![Extent { logical: 9, len: 1, physical: 3, unwritten: false }; EXTENTS_PER_BLOCK],
        };
        e.encode(&mut b);
        assert_eq!(ExtentBlock::decode(&b).unwrap(), e);
        let mut slots = vec![None; DIRENTS_PER_BLOCK];
        slots[3] = Some(Dirent { ino: 12, ftype: 1, name: vec![b'x'; NAME_MAX] });
        dir_block_encode(2, &slots, &mut b);
        assert_eq!(dir_block_decode(2, &b).unwrap(), slots);
        assert!(dir_block_decode(3, &b).is_err(), "owner is checked");
        let d = JournalDesc { seq: 8, tags: vec![1, 2, 3], revokes: vec![4] };
        d.encode(&mut b);
        assert_eq!(JournalDesc::decode(&b).unwrap(), d);
        let c = JournalCommit { seq: 8, n_desc: 1, n_images: 3, body_crc: 0xdead, extra: vec![1, 2] };
        c.encode(&mut b);
        assert_eq!(JournalCommit::decode(&b).unwrap(), c);
        let x = XattrBlock { ino: 3, entries: vec![(b"user.a".to_vec(), vec![1, 2]), (b"user.b".to_vec(), vec![])] };
        x.encode(&mut b);
        assert_eq!(XattrBlock::decode(&b).unwrap(), x);
        let h = JournalHeader { start_seq: 99 };
        h.encode(&mut b);
        assert_eq!(JournalHeader::decode(&b).unwrap(), h);
        b.fill(0xff);
        bitmap_seal(&mut b, 3);
        bitmap_check(&b, 3).unwrap();
        assert!(bitmap_check(&b, 4).is_err());
    }

    /// Regions laid out in order whose sum wraps past u64::MAX: refused, no overflow.
    #[test]
    fn superblock_regions_near_the_top_of_u64_are_refused() {
        let mut sb = Superblock::layout(64, 16, 16, [7; 16], 0).unwrap();
        let shift = u64::MAX - 10 - sb.journal_blocks;
        sb.journal_blocks += shift;
        sb.inode_bitmap_start += shift;
        sb.block_bitmap_start += shift;
        sb.inode_table_start += shift;
        sb.data_start += shift;
        let mut b = vec![0; BLOCK_SIZE];
        sb.encode(&mut b);
        assert!(Superblock::decode(&b).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// No decoder panics on any bytes, of any length.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..BLOCK_SIZE + 8), flip in any::<u64>()) {
            let mut block = bytes.clone();
            block.resize(BLOCK_SIZE, (flip & 0xff) as u8);
            for b in [&bytes[..], &block[..]] {
                let _ = Superblock::decode(b);
                let _ = ExtentBlock::decode(b);
                let _ = dir_block_decode(flip, b);
                let _ = JournalHeader::decode(b);
                let _ = JournalDesc::decode(b);
                let _ = JournalCommit::decode(b);
                let _ = JournalDelta::decode_all(b);
                let _ = bitmap_check(b, flip);
                let _ = XattrBlock::decode(b);
                let _ = xattr_decode_head(b, flip);
                let _ = xattr_decode_cont(b, flip, (flip % 70) as usize);
                let _ = xattr_parse(b, (flip % 300) as u32);
                if b.len() >= INODE_SIZE {
                    let _ = DiskInode::decode(flip, &b[..INODE_SIZE]);
                }
            }
        }

        /// Valid structures with random bytes flipped: decode errors, or returns a value.
        #[test]
        fn corrupted_valid_blocks_never_panic(at in 0..BLOCK_SIZE, x in 1u8..=255) {
            let mut b = vec![0; BLOCK_SIZE];
            sb().encode(&mut b);
            b[at] ^= x;
            if (SB_STATE_AT..SB_STATE_AT + 8).contains(&at) {
                // The state word is outside the checksum: damage only makes it "not clean".
                prop_assert!(!Superblock::decode(&b).unwrap().clean);
            } else {
                prop_assert!(Superblock::decode(&b).is_err());
            }
            let mut slots = vec![None; DIRENTS_PER_BLOCK];
            slots[0] = Some(Dirent { ino: 3, ftype: 1, name: b"abc".to_vec() });
            dir_block_encode(2, &slots, &mut b);
            b[at] ^= x;
            prop_assert!(dir_block_decode(2, &b).is_err());
        }
    }
}
