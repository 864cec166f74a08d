// A Go program with cgo (so its threads are the C library's, and Frida can load into it):
// calls f 1000 times in main and 200,000 times in each of 4 goroutines, recovers from a
// nil dereference (the runtime's SIGSEGV handler sends the thread on to sigpanic), and
// prints "2 3500 2800000 recovered".  With an argument it then dereferences nil unrecovered
// and dies in a panic (exit status 2).
package main

// int twice(int x) { return 2 * x; }
import "C"

import (
	"fmt"
	"os"
	"sync"
)

//go:noinline
func f(i int) int { return i & 7 }

//go:noinline
func nilDeref(p *int) int { return *p }

func recovered() (r string) {
	defer func() {
		if e := recover(); e != nil {
			r = "recovered"
		}
	}()
	var p *int
	nilDeref(p)
	return "not recovered"
}

func main() {
	sum := 0
	for i := 0; i < 1000; i++ {
		sum += f(i)
	}
	var wg sync.WaitGroup
	total := make([]int, 4)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 200000; i++ {
				total[g] += f(i)
			}
		}(g)
	}
	wg.Wait()
	fmt.Println(int(C.twice(1)), sum, total[0]+total[1]+total[2]+total[3], recovered())
	if len(os.Args) > 1 {
		var p *int
		fmt.Println(nilDeref(p))
	}
}
