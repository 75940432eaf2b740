// Command placeandmatch is the Go client's example (docs/gateway.md, "The Go client"): a
// placement, then a match that finds it, against a running mmcache serve.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"mmcache/clients/go/mmcache"
)

func main() {
	mm, err := mmcache.New(os.Getenv("MMCACHE_URL"), // e.g. http://127.0.0.1:8080
		mmcache.WithToken(os.Getenv("MMCACHE_TOKEN")),            // unset: no header
		mmcache.WithMatchToken(os.Getenv("MMCACHE_MATCH_TOKEN"))) // unset: MMCACHE_TOKEN
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	body := mmcache.ChatCompletions([]byte(`{"model": "m", "messages": [{"role": "user", "content": [
		{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}`))
	pods := []string{"default/vllm-0", "default/vllm-1"}

	// PreRequest of an earlier request: it went to vllm-1
	accepted, err := mm.Place(ctx, mmcache.PlacementRequest{RequestID: "r-1", Endpoints: pods[1:], Body: body})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("placed, events:", accepted.Events)

	// Produce of the next request with the same image (eventual: milliseconds, usually)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		scores, _, err := mm.Scores(ctx, pods, body)
		if err != nil {
			log.Print(err) // best effort: the scores are all 0 then
		}
		if scores["default/vllm-1"] == 1 {
			fmt.Println("scores:", scores)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	log.Fatal("the placement did not show")
}
