module mmcache/clients/go/mmcache

go 1.19
