-- Put in front of the batch record's scripts (wire/lua/__init__.py): Redis's clock as a
-- number of seconds, and times as the record writes them ('%.6f').
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end
