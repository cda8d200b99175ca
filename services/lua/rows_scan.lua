-- One step of a scan of an embedding table's hash in a shard group's slot (rows, sighting records, or
-- a checkpoint's shadow of either), returned as bulk bytes: the IDs concatenated and the records (or a
-- prefix of each) concatenated, never one reply per entry. What it leaves out makes a checkpoint's
-- passes (services/snapshot/table_cut.py): rows written after the cut (their version is above it),
-- sighting records the applies shadowed since the cut (the shadow holds the cut's), and the ''
-- markers of a seen shadow (no record at the cut).
--
-- Called through services.scripts.RowsScanCall, which renders KEYS and ARGV by the names below.
-- KEYS[1] version        the group's version
-- KEYS[2] hash           the hash scanned
-- KEYS[3] skip           a hash of the same slot: its IDs are left out when skip_present is 1
-- ARGV[1] cursor         where this step starts ('0': from the start)
-- ARGV[2] count          entries this step looks at (HSCAN's COUNT)
-- ARGV[3] width          bytes of each record; entries of another size are left out
-- ARGV[4] prefix         bytes of each record returned (its start: version and values of a row)
-- ARGV[5] newest         leave out rows whose version (first 8 bytes, u64 little-endian) is above
--                        this; -1: keep every entry
-- ARGV[6] skip_present   1: leave out the IDs present in KEYS[3]
--
-- Returns {next cursor ('0': the scan is complete), the group's version, IDs, records}.
local K_VERSION = 1
local K_HASH = 2
local K_SKIP = 3
local A_CURSOR = 1
local A_COUNT = 2
local A_WIDTH = 3
local A_PREFIX = 4
local A_NEWEST = 5
local A_SKIP_PRESENT = 6

local width, prefix, newest = tonumber(ARGV[A_WIDTH]), tonumber(ARGV[A_PREFIX]), tonumber(ARGV[A_NEWEST])
local skip = ARGV[A_SKIP_PRESENT] == '1'
local step = redis.call('HSCAN', KEYS[K_HASH], ARGV[A_CURSOR], 'COUNT', ARGV[A_COUNT])
local entries, ids, records = step[2], {}, {}
for j = 1, #entries, 2 do
  local id, record = entries[j], entries[j + 1]
  local keep = #record == width and #id == 8
  if keep and newest >= 0 and struct.unpack('<I8', record) > newest then
    keep = false
  end
  if keep and skip and redis.call('HEXISTS', KEYS[K_SKIP], id) == 1 then
    keep = false
  end
  if keep then
    ids[#ids + 1] = id
    records[#records + 1] = prefix < width and string.sub(record, 1, prefix) or record
  end
end
return {step[1], redis.call('GET', KEYS[K_VERSION]) or '0', table.concat(ids), table.concat(records)}
